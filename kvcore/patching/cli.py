"""``kvcore patches {list,check,apply,revert,generate}``: the patch sets against engine trees.

Exit status: 0 done (check: every file applied, or every file pristine); 1 refused,
mixed, or drifted; 2 a usage error, no such tree, a release with no patch set, or (list)
no patch set at all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcore.patching import apply as apply_module
from kvcore.patching.apply import FileState, PatchError
from kvcore.patching.generate import GenerateError, drift, generate, write_set
from kvcore.patching.patchset import (
    DEFAULT_PATCHES_DIR,
    NoPatchSet,
    PatchSet,
    available_versions,
    load_set,
)
from kvcore.patching.spec import ADAPTER_SPECS, EngineSpec, PatchTarget, spec_for
from kvcore.patching.tree import EngineTree, TreeError, find_tree


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``patches`` and its subcommands to kvcore's command parser."""
    patches = commands.add_parser(
        "patches",
        help="list, check, apply or revert the vendored engine patches",
        description="The vendored patches: the adapters' hooks written into an engine's source.",
    )
    actions = patches.add_subparsers(dest="action", metavar="ACTION", required=True)
    helps = {
        "list": "the patch sets there are, per engine and release",
        "check": "each patched file in the tree: applied, pristine or modified elsewhere",
        "apply": "patch the tree (all files or none; only a tree as released)",
        "revert": "restore the original bytes of every patched file",
        "generate": "regenerate the release's patch set from the adapter (--check: drift)",
    }
    for action, text in helps.items():
        sub = actions.add_parser(action, help=text, description=text)
        sub.add_argument(
            "--engine", required=action != "list", choices=sorted(ADAPTER_SPECS), help="engine"
        )
        sub.add_argument(
            "--patches",
            type=Path,
            default=DEFAULT_PATCHES_DIR,
            help="the directory of patch sets (default: %(default)s)",
        )
        if action == "list":
            continue
        sub.add_argument(
            "--target",
            type=Path,
            help="a source tree, site-packages, or the package directory "
            "(default: the engine installed for this interpreter)",
        )
        sub.add_argument("--version", help="the release the tree holds (default: detected)")
        if action in ("apply", "revert"):
            sub.add_argument(
                "--builtin",
                action="store_true",
                help="apply the hunks in Python even where patch(1) is installed",
            )
        if action == "generate":
            sub.add_argument(
                "--check",
                action="store_true",
                help="write nothing; fail when the committed patch set differs",
            )
    patches.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(args)
    try:
        spec = spec_for(args.engine)
        tree = find_tree(spec, args.target, args.version)
        if args.action == "generate":
            return _generate(spec, tree, args)
        patch_set, directory = load_set(args.patches, spec.engine, tree.version)
    except (TreeError, NoPatchSet) as exc:
        print(f"kvcore patches {args.action}: {exc}", file=sys.stderr)
        return 2
    if args.action == "check":
        return _check(patch_set, tree)
    return _change(args, patch_set, directory, tree)


def _check(patch_set: PatchSet, tree: EngineTree) -> int:
    reports = apply_module.check(patch_set, tree)
    states = {r.state for r in reports}
    overall = states.pop().value if len(states) == 1 else "mixed"
    print(f"{patch_set.engine} {tree.version} in {tree.root}: {overall}")
    for report in reports:
        print(f"  {report.state.value:<18} {report.file.path}")
    return 0 if overall in (FileState.APPLIED.value, FileState.PRISTINE.value) else 1


def _change(
    args: argparse.Namespace, patch_set: PatchSet, directory: Path, tree: EngineTree
) -> int:
    applying = args.action == "apply"
    change = apply_module.apply if applying else apply_module.revert
    try:
        changed = change(patch_set, directory, tree, use_program=False if args.builtin else None)
    except PatchError as exc:
        print(f"kvcore patches {args.action}: {exc}", file=sys.stderr)
        return 1
    where = f"{patch_set.engine} {tree.version} in {tree.root}"
    if not changed:
        print(f"{where}: already {'applied' if applying else 'pristine'}")
    else:
        print(f"{where}: {'patched' if applying else 'restored'} {len(changed)} file(s)")
    for path in changed:
        print(f"  {path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    engines = [args.engine] if args.engine else sorted(ADAPTER_SPECS)
    found = {engine: available_versions(args.patches, engine) for engine in engines}
    if not any(found.values()):
        fix = (
            "the patch sets kvcore ships are missing from this install: reinstall kvcore"
            if args.patches == DEFAULT_PATCHES_DIR
            else "give --patches the folder that holds <engine>/<version>/manifest.json"
        )
        print(
            f"kvcore patches list: no patch sets for {' or '.join(engines)} in "
            f"{args.patches}; {fix}",
            file=sys.stderr,
        )
        return 2
    for engine, versions in found.items():
        print(f"{engine}: {', '.join(versions) or 'no patch sets'}")
        for version in versions:
            patch_set, _ = load_set(args.patches, engine, version)
            for file in patch_set.files:
                hooked = ", ".join(PatchTarget.from_dotted(t).expression for t in file.targets)
                print(f"  {version}  {file.path}: {hooked}")
    return 0


def _generate(spec: EngineSpec, tree: EngineTree, args: argparse.Namespace) -> int:
    try:
        generated = generate(spec, tree)
    except GenerateError as exc:
        print(f"kvcore patches generate: {exc}", file=sys.stderr)
        return 1
    if args.check:
        problems = drift(generated, args.patches)
        for problem in problems:
            print(f"drift: {problem}", file=sys.stderr)
        if not problems:
            print(
                f"{spec.engine} {generated.patch_set.version}: the committed patch set is current"
            )
        return 1 if problems else 0
    print(f"wrote {write_set(generated, args.patches)}")
    return 0
