"""Run-wide counters printed at the end of a pytest run (examples per world size, malformed inputs tried, ...)."""

from __future__ import annotations

import collections

COUNTERS: collections.Counter[str] = collections.Counter()


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to the counter ``name``."""
    COUNTERS[name] += n
