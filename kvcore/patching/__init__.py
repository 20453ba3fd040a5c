"""Vendored patches: the adapters' runtime hooks written into an engine's own source.

A patch set (``patches/<engine>/<version>/``) is one unified diff per changed module
plus ``manifest.json`` with each file's pristine and patched sha256. It is generated
from the adapter's target table (:mod:`kvcore.patching.generate`), applied and
reverted all-or-nothing (:mod:`kvcore.patching.apply`), and driven by
``kvcore patches`` (:mod:`kvcore.patching.cli`). Nothing here imports an engine.
"""
