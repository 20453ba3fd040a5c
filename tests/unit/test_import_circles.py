"""No circle of imports among kvcore's product modules and the adapters: each module stands
above what it imports. Module-level imports count, those only for type checking too; an
import inside a function (a lazy entry such as the kernel registry's CUDA set) does not,
since it runs after both modules have loaded, nor a module named in a string (looked up
at run time, as the patch specs and vLLM's installation do). kvcore/bench is measured apart
(test_bench_boundary)."""

from __future__ import annotations

from tests.support.imports import imported_modules, product_modules


def _graph() -> dict[str, set[str]]:
    modules = product_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = imported_modules(
            name,
            path.read_text(encoding="utf-8"),
            lambda imported: imported in modules,
            is_package=path.name == "__init__.py",
            strings=False,
        )
        graph[name] = {imported for imported, in_function in found if not in_function} - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_product_modules_import_in_no_circle() -> None:
    graph = _graph()
    assert {"kvcore.planning.plans", "kvcore.kernels.reference", "kvcore_sglang.transfers"} <= set(
        graph
    )
    assert "kvcore.row_words" in graph["kvcore.planning.plans"]
    assert circles(graph) == []


def test_a_circle_is_found_with_every_module_in_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
