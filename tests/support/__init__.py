"""Scaffolding that only tests use, kept out of the product packages (imported as
``tests.support.<module>``; the repository root is on pytest's path)."""
