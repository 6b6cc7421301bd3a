"""Both ways of starting the ranks run a case the same way.

The default pool forks its ranks from one launcher process (``launcher="fork"``); the nccl pool and the
bench's fresh-per-case baseline start them with ``torchrun``. A 2-rank torchrun pool on gloo must give
bit-for-bit the same rank outputs as the session's forked ranks for the same cases, so the torchrun path
that the nightly GPU job takes stays exercised on CPU.
"""

from __future__ import annotations

import numpy as np

from cp_harness.pool import PoolConfig, RankPool

CASES = [
    {"check": "gather_sequence", "world_size": 2, "seed": 4, "dtype": "float32", "shape": [2, 3, 4],
     "differentiable": True},
    {"check": "model", "world_size": 2, "seed": 5, "model": "inkling2", "dtype": "float64", "num_chunks": 1,
     "batch": {"format": "thd", "seq_len": 9, "docs": [[[4, 5], [3, 4]]]}},
]


def test_torchrun_ranks_compute_what_forked_ranks_compute(cp_runner):
    forked = [cp_runner.run_outputs({**case, "impl": "cp_impl"}) for case in CASES]
    assert cp_runner.pool.launcher == ("torchrun" if cp_runner.config.backend == "nccl" else "fork")
    with RankPool(PoolConfig(world_size=2, backend=cp_runner.config.backend, launcher="torchrun")) as pool:
        assert pool.launcher == "torchrun"
        assert [pool.hello[r]["rank"] for r in range(2)] == [0, 1]
        for case, expected in zip(CASES, forked):
            outputs = pool.run({**case, "impl": "cp_impl"})
            for got, want in zip(outputs, expected):
                assert got.ok and want.ok
                assert sorted(got.tensors) == sorted(want.tensors)
                for name in want.tensors:
                    np.testing.assert_array_equal(got.tensors[name], want.tensors[name], err_msg=f"{case['check']}: {name}")
