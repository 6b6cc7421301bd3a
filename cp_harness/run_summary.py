"""Run-wide counters and notes printed at the end of a pytest run (examples per world size, malformed inputs
tried, contract differences found, ...)."""

from __future__ import annotations

import collections

COUNTERS: collections.Counter[str] = collections.Counter()


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to the counter ``name``."""
    COUNTERS[name] += n


NOTES: list[str] = []


def note(text: str) -> None:
    """A line for the end-of-run summary (e.g. a contract difference a test found and how it is treated)."""
    if text not in NOTES:
        NOTES.append(text)
