"""The engine functions an adapter's source calls or overrides, found by reading both.

A version guard can only vouch for the engine functions its table fingerprints; this
module finds the ones an adapter depends on, so that a test can require each of them in
the table. Nothing is imported: the adapter modules are read as text, the engine from
its source tree. A use is found where the adapter

- overrides a method: a method of a class whose bases are engine classes it imported
  by name, where those bases define it;
- calls a method through ``super()`` in such a class (constructors included);
- calls an engine function or constructs an engine class it imported by name (the
  class's ``__init__``, where its source defines one);
- calls ``<anything>.name(...)`` where ``name`` is a method of one of the engine classes
  given (those of the guard's table) or of an engine class the module imports, through
  their bases. The receiver's type is not known, so a name is matched on every such
  class: more uses than strictly needed, never fewer;
- calls such an attribute that an engine class binds on its instances
  (``self.name = ...``): the method that binds it, and the engine methods and functions
  the bound expression names, are uses.

Names with double underscores are matched only through ``super()`` and constructors.
Data attributes that are read, not called, are not uses.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

_Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True, order=True)
class StockUse:
    """One engine function an adapter depends on, and where and how it does."""

    target: str
    """The function's dotted name, as a guard's table names it."""
    site: str
    """``<adapter module>:<line>`` of the use."""
    how: str


@dataclass
class EngineClass:
    """A class of the engine's source: its methods, bases and instance attributes."""

    name: str
    """Dotted name, ``package.module.Class``."""
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    bases: list[str]
    """Engine bases, dotted; bases from outside the engine are left out."""
    bound: dict[str, list[tuple[str, ast.expr]]] = field(default_factory=dict)
    """Attribute -> (method, value) of each ``self.<attribute> = value`` in its methods."""


class EngineSource:
    """An engine's source tree under ``root`` (the directory holding ``package``), parsed
    module by module as names are resolved."""

    def __init__(self, root: Path, package: str) -> None:
        self.root = root
        self.package = package
        self._modules: dict[str, ast.Module | None] = {}
        self._classes: dict[str, EngineClass | None] = {}
        self._imports: dict[str, dict[str, str]] = {}

    def module(self, name: str) -> ast.Module | None:
        """The parsed module ``name``; None when it is not a file of the tree."""
        if name not in self._modules:
            tree = None
            base = self.root.joinpath(*name.split("."))
            for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
                if path.is_file():
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                    break
            self._modules[name] = tree
        return self._modules[name]

    def resolve(self, module: str, name: str, depth: int = 0) -> str | None:
        """The dotted name of the definition ``name`` has in ``module``, following its
        imports within the engine; None when it is not the engine's."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, _Definition) and node.name == name:
                return f"{module}.{name}"
        imported = self.imports(module).get(name)
        if imported is None or not imported.startswith(self.package + "."):
            return None
        return self.resolve(*_split_last(imported), depth + 1)

    def definition(self, dotted: str) -> ast.AST | None:
        """The top-level class or function ``dotted`` names; None if the tree has none."""
        module, name = _split_last(dotted)
        tree = self.module(module)
        body = tree.body if tree is not None else []
        nodes = [n for n in body if isinstance(n, _Definition) and n.name == name]
        return nodes[-1] if nodes else None

    def imports(self, module: str) -> dict[str, str]:
        """Local name -> dotted name of every import in ``module``."""
        if module not in self._imports:
            tree = self.module(module)
            base = self.root.joinpath(*module.split("."))
            package = module if (base / "__init__.py").is_file() else _split_last(module)[0]
            self._imports[module] = {} if tree is None else _imports(tree, package)
        return self._imports[module]

    def engine_class(self, dotted: str) -> EngineClass | None:
        """The engine class ``dotted``; None if it is not a class of the tree."""
        if dotted not in self._classes:
            self._classes[dotted] = None
            node = self.definition(dotted)
            if isinstance(node, ast.ClassDef):
                self._classes[dotted] = self._describe(dotted, node)
        return self._classes[dotted]

    def lineage(self, dotted: str) -> list[EngineClass]:
        """``dotted`` and its engine bases, depth first, left to right, each once."""
        seen: dict[str, EngineClass] = {}
        pending = [dotted]
        while pending:
            name = pending.pop(0)
            described = self.engine_class(name)
            if described is None or name in seen:
                continue
            seen[name] = described
            pending[:0] = described.bases
        return list(seen.values())

    def _describe(self, dotted: str, node: ast.ClassDef) -> EngineClass:
        module = dotted.rpartition(".")[0]
        bases = []
        for base in node.bases:
            resolved = self._resolve_expression(module, base)
            if resolved is not None:
                bases.append(resolved)
        methods = {
            n.name: n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        described = EngineClass(dotted, methods, bases)
        for method in methods.values():
            for attribute, value in _self_assignments(method):
                described.bound.setdefault(attribute, []).append((method.name, value))
        return described

    def _resolve_expression(self, module: str, expression: ast.expr) -> str | None:
        if isinstance(expression, ast.Name):
            return self.resolve(module, expression.id)
        if isinstance(expression, ast.Attribute):
            dotted = _dotted(expression)
            head, _, rest = (dotted or "").partition(".")
            imported = self.imports(module).get(head)
            if imported is None:
                return None
            return self.resolve(*_split_last(f"{imported}.{rest}"))
        return None


def stock_uses(
    adapter_sources: Mapping[str, str], engine: EngineSource, classes: Iterable[str]
) -> list[StockUse]:
    """Every use of an engine function in the adapter modules (name -> source text),
    sorted; ``classes`` are the engine classes whose methods a call by name may reach."""
    uses: set[StockUse] = set()
    for name, source in adapter_sources.items():
        uses.update(_module_uses(name, ast.parse(source), engine, tuple(classes)))
    return sorted(uses)


def _module_uses(
    name: str, tree: ast.Module, engine: EngineSource, classes: tuple[str, ...]
) -> Iterator[StockUse]:
    imported = {
        local: dotted
        for local, dotted in _imports(tree, name.rpartition(".")[0]).items()
        if dotted.startswith(engine.package + ".")
    }
    resolved = {local: engine.resolve(*_split_last(dotted)) for local, dotted in imported.items()}
    imported_classes = [d for d in resolved.values() if d and engine.engine_class(d)]
    lineages = [engine.lineage(dotted) for dotted in dict.fromkeys((*classes, *imported_classes))]

    def site(node: ast.AST) -> str:
        return f"{name}:{getattr(node, 'lineno', 0)}"

    for klass in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = [
            resolved.get(b.id) for b in klass.bases if isinstance(b, ast.Name) and b.id in resolved
        ]
        lineage = [c for b in bases if b for c in engine.lineage(b)]
        if not lineage:
            continue
        for method in klass.body:
            if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                for target in _methods_named(lineage, method.name):
                    yield StockUse(target, site(method), "overrides")
        for call in (n for n in ast.walk(klass) if isinstance(n, ast.Call)):
            func = call.func
            if isinstance(func, ast.Attribute) and _is_super(func.value):
                for target in _methods_named(lineage, func.attr):
                    yield StockUse(target, site(call), "calls through super()")

    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Name) and resolved.get(func.id):
            dotted = resolved[func.id]
            assert dotted is not None
            if engine.engine_class(dotted) is None:
                yield StockUse(dotted, site(call), "calls")
            else:
                for target in _methods_named(engine.lineage(dotted), "__init__"):
                    yield StockUse(target, site(call), "constructs")
        elif (
            isinstance(func, ast.Attribute)
            and not _is_super(func.value)
            and not func.attr.startswith("__")
        ):
            for target, how in _attribute_uses(engine, lineages, func.attr):
                yield StockUse(target, site(call), how)


def _methods_named(lineage: list[EngineClass], name: str) -> list[str]:
    """The method ``name`` that the first class of ``lineage`` defining it defines."""
    for klass in lineage:
        if name in klass.methods:
            return [f"{klass.name}.{name}"]
    return []


def _attribute_uses(
    engine: EngineSource, lineages: list[list[EngineClass]], attribute: str
) -> Iterator[tuple[str, str]]:
    """What calling ``attribute`` on an instance of each lineage's class runs: the method
    its class or a base defines, or the attribute its class or a base binds."""
    for lineage in lineages:
        for klass in lineage:
            if attribute in klass.methods:
                yield f"{klass.name}.{attribute}", "calls"
                break
            if attribute in klass.bound:
                for method, value in klass.bound[attribute]:
                    yield f"{klass.name}.{method}", f"calls .{attribute}, bound here"
                    for target in _named_in(engine, klass, value):
                        yield target, f"calls .{attribute}, bound to it"
                break


def _named_in(engine: EngineSource, klass: EngineClass, value: ast.expr) -> Iterator[str]:
    """The engine methods (``self.m``) and functions (called by name) ``value`` names."""
    lineage = engine.lineage(klass.name)
    module = klass.name.rpartition(".")[0]
    for node in ast.walk(value):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self":
                yield from _methods_named(lineage, node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            dotted = engine.resolve(module, node.func.id)
            if dotted is not None and engine.engine_class(dotted) is None:
                yield dotted


def _imports(tree: ast.Module, package: str) -> dict[str, str]:
    """Local name -> dotted name of what it was imported as, anywhere in ``tree`` (a module
    of ``package``, against which relative imports resolve)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = package.split(".")
                source = ".".join(
                    parts[: len(parts) - node.level + 1] + ([source] if source else [])
                )
            for alias in node.names:
                names[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".", 1)[0]
                    names[head] = head
    return names


def _self_assignments(
    method: ast.FunctionDef | ast.AsyncFunctionDef,
) -> Iterator[tuple[str, ast.expr]]:
    for node in ast.walk(method):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if (
                value is not None
                and isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                yield target.attr, value


def _split_last(dotted: str) -> tuple[str, str]:
    owner, _, name = dotted.rpartition(".")
    return owner, name


def _dotted(expression: ast.expr) -> str | None:
    if isinstance(expression, ast.Name):
        return expression.id
    if isinstance(expression, ast.Attribute):
        head = _dotted(expression.value)
        return None if head is None else f"{head}.{expression.attr}"
    return None


def _is_super(expression: ast.expr) -> bool:
    return (
        isinstance(expression, ast.Call)
        and isinstance(expression.func, ast.Name)
        and expression.func.id == "super"
    )
