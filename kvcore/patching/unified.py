"""Unified diffs of one file: written from two texts, read back, applied either way.

Lines are split on ``\\n`` only (engine sources contain form feeds, which
``str.splitlines`` would also split on), and a last line without a newline is
marked the way diff(1) and patch(1) mark it, so applying a diff reproduces the
bytes exactly. Hunks apply only where they say; there is no fuzz.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

NO_NEWLINE = "\\ No newline at end of file\n"
_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class DiffError(ValueError):
    """A diff that cannot be read, or that does not match the text it is applied to."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based first line; for an empty range, the line before it
    new_start: int
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]


@dataclass(frozen=True)
class FileDiff:
    old_path: str
    new_path: str
    hunks: tuple[Hunk, ...]


def split_lines(text: str) -> list[str]:
    """``text``'s lines, each with its ``\\n`` (the last may have none)."""
    lines = text.split("\n")
    last = lines.pop()
    return [line + "\n" for line in lines] + ([last] if last else [])


def make_diff(old_path: str, new_path: str, old: str, new: str, context: int = 3) -> str:
    """The unified diff that turns ``old`` into ``new``; empty when they are equal."""
    out: list[str] = []
    for line in difflib.unified_diff(
        split_lines(old), split_lines(new), old_path, new_path, n=context
    ):
        out.append(line if line.endswith("\n") else line + "\n" + NO_NEWLINE)
    return "".join(out)


def parse_diff(text: str) -> list[FileDiff]:
    """Every file diff in ``text`` (as written by :func:`make_diff` or diff -u)."""
    lines = split_lines(text)
    files: list[FileDiff] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise DiffError(f"line {i + 1}: '---' without '+++'")
        old_path, new_path = _path(lines[i]), _path(lines[i + 1])
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _read_hunk(lines, i)
            hunks.append(hunk)
        files.append(FileDiff(old_path, new_path, tuple(hunks)))
    return files


def apply_diff(text: str, diff: FileDiff, *, reverse: bool = False) -> str:
    """``text`` with ``diff`` applied (undone when ``reverse``); DiffError where it differs."""
    lines = split_lines(text)
    out: list[str] = []
    at = 0  # index into lines of the next line not yet copied
    for hunk in diff.hunks:
        start, old, new = (
            (hunk.new_start, hunk.new_lines, hunk.old_lines)
            if reverse
            else (hunk.old_start, hunk.old_lines, hunk.new_lines)
        )
        begin = start - 1 if old else start
        if begin < at or lines[begin : begin + len(old)] != list(old):
            raise DiffError(f"{diff.old_path}: hunk at line {start} does not match")
        out.extend(lines[at:begin])
        out.extend(new)
        at = begin + len(old)
    out.extend(lines[at:])
    return "".join(out)


def _path(header: str) -> str:
    # diff -u appends a tab and a timestamp; difflib appends nothing when given no dates.
    return header[4:].rstrip("\n").split("\t", 1)[0]


def _read_hunk(lines: list[str], i: int) -> tuple[Hunk, int]:
    match = _HUNK_HEADER.match(lines[i])
    if match is None:
        raise DiffError(f"line {i + 1}: bad hunk header {lines[i]!r}")
    old_start, old_count, new_start, new_count = (
        int(match[1]),
        int(match[2] or 1),
        int(match[3]),
        int(match[4] or 1),
    )
    old: list[str] = []
    new: list[str] = []
    i += 1
    last: list[list[str]] = []  # the side(s) the previous line went to
    while i < len(lines) and (len(old) < old_count or len(new) < new_count):
        line = lines[i]
        kind, body = line[:1], line[1:]
        if kind == " ":
            old.append(body)
            new.append(body)
            last = [old, new]
        elif kind == "-":
            old.append(body)
            last = [old]
        elif kind == "+":
            new.append(body)
            last = [new]
        else:
            raise DiffError(f"line {i + 1}: unexpected {line!r} inside a hunk")
        i += 1
        if i < len(lines) and lines[i] == NO_NEWLINE:
            for side in last:
                side[-1] = side[-1].removesuffix("\n")
            i += 1
    if len(old) != old_count or len(new) != new_count:
        raise DiffError(f"hunk {lines[i - 1]!r}: counts do not match its header")
    return Hunk(old_start, new_start, tuple(old), tuple(new)), i
