"""The engine compatibility matrix: lanes from ci/matrix.toml, run in cached venvs,
summarised in docs/compat.md. ``python -m ci.matrix --help`` for the commands."""
