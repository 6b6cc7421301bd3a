"""The cases the benchmark times: the standard model case, the pool's floor and the long memory case.

Each is a plain case description, the same JSON a test or ``run-case`` takes,
so any timed case can be reproduced on its own. Check names come from the
checks' own modules.
"""

from __future__ import annotations

import json

from cp_harness.checks import bench_memory, models, pool_selftest

# Two packed rows: documents with per-document padding, and tail padding in the second row.
STANDARD_LAYOUT = {"format": "thd", "seq_len": 64, "docs": [[[20, 22], [30, 30], [10, 12]], [[40, 41], [15, 15]]]}


def standard_case(seed: int, world_size: int) -> dict:
    """The standard throughput case: Inkling2-mini forward and backward, batch 2, sequence 64, float64.

    Two packed rows (documents with per-document padding, tail padding in the
    second row), so the layout hook, the convolution halo, both gathers and
    the loss reduction all run.
    """
    return {
        "check": models.MODEL.name,
        "world_size": int(world_size),
        "seed": int(seed),
        "model": "inkling2",
        "dtype": "float64",
        "batch": json.loads(json.dumps(STANDARD_LAYOUT)),
        "num_chunks": 1,
    }


def floor_case(seed: int, world_size: int) -> dict:
    """The pool's own floor: a case that only all-reduces one number, so its time is the pool's overhead."""
    return {"check": pool_selftest.POOL_SELFTEST.name, "world_size": world_size, "seed": seed, "mode": "ok"}


def memory_case(world_size: int, seq_len: int, dtype: str) -> dict:
    """One row of ``seq_len`` tokens packed with three documents (a quarter, a half, the rest)."""
    quarter = seq_len // 4
    docs = [[quarter, quarter], [2 * quarter, 2 * quarter], [seq_len - 3 * quarter, seq_len - 3 * quarter]]
    return {
        "check": bench_memory.BENCH_MEMORY.name,
        "world_size": int(world_size),
        "seed": 0,
        "model": "inkling2",
        "dtype": dtype,
        "batch": {"format": "thd", "seq_len": int(seq_len), "docs": [docs]},
        "num_chunks": 1,
    }
