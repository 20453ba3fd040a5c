"""Shared by the engine lanes: pytest puts this directory on sys.path for the tests below it,
so they can import patch_support."""
