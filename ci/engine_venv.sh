# Sourced by ci/install_<engine>.sh: builds one engine's CPU lane venv.
#
#   build_engine_venv VENV CONSTRAINTS "ENGINE==VERSION" CHECK_IMPORT DEP...
#
# torch 2.13.0 (CPU) and kvcore (editable, with its dev extra) under CONSTRAINTS, the engine
# with --no-deps (its own dependency tree pins a CUDA torch and GPU kernel packages), then
# the modules it imports at run time; finally it proves no CUDA torch slipped in and that
# CHECK_IMPORT (a module of the engine) imports. Safe to run again: an existing venv is
# reused and pip skips what is installed.
build_engine_venv() {
    local venv="$1" constraints="$2" engine="$3" check_import="$4"
    shift 4
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ ! -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
    fi
    local pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
    "${pip[@]}" -c "$constraints" torch==2.13.0
    "${pip[@]}" -c "$constraints" -e "$repo[dev]"
    # pip then lists the engine's own pins it leaves unmet (CUDA torch, kernel packages):
    # expected, since only the modules kvcore's tests import are installed.
    "${pip[@]}" --no-deps "$engine"
    "${pip[@]}" -c "$constraints" "$@"
    "$venv/bin/python" - "${engine%%==*}" "$check_import" <<'PY'
import importlib
import importlib.metadata as md
import sys

import torch

distribution, module = sys.argv[1:]
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
importlib.import_module(module)
print(f"{distribution} {md.version(distribution)}, torch {torch.__version__}")
PY
}
