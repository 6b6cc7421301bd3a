"""The same case run twice gives bit-identical results on every rank.

A failure is only useful if it reproduces: the case description must rebuild
the same inputs, and the implementation must compute the same bits from them.
Each case below runs twice on the session's pool; every tensor every rank
returns (outputs, losses, input and parameter gradients), its ``info`` and the
collectives it made must be identical, bit for bit (``-0.0`` differs from
``0.0``, NaN payloads count). The companion test
``tests/ranks/test_pool_faults.py`` runs a failing case's printed reproduction
command.
"""

from __future__ import annotations

import numpy as np
import pytest

CASES = [
    pytest.param(
        {
            "check": "model",
            "world_size": 4,
            "seed": 31,
            "model": "inkling2",
            "dtype": "float64",
            "num_chunks": 1,
            "batch": {
                "format": "thd",
                "seq_len": 13,
                "docs": [[[5, 6], [4, 4], [2, 3]]],
                "images": [[0, 1, 2, 4]],
                "eos_is_pad": True,
            },
        },
        id="model-inkling2-float64",
    ),
    pytest.param(
        {
            "check": "model",
            "world_size": 3,
            "seed": 32,
            "model": "mistral_large4",
            "dtype": "float32",
            "num_chunks": 2,
            "shard_primary": False,
            "batch": {
                "format": "thd",
                "seq_len": 11,
                "docs": [[[4, 5], [6, 6]], [[11, 11]]],
                "images": {"height": 2, "width": 4, "spans": [[1, 3, 2]]},
            },
        },
        id="model-mistral_large4-float32",
    ),
    pytest.param(
        {
            "check": "convolution_history",
            "world_size": 3,
            "seed": 33,
            "dtype": "float32",
            "shape": [2, 2, 3],
            "width": 6,
        },
        id="transport-convolution_history",
    ),
    pytest.param(
        {
            "check": "shifted_cp_loss",
            "world_size": 2,
            "seed": 34,
            "model": "mistral_large4",
            "dtype": "float32",
            "vocab": 9,
            "batch": {"format": "bshd", "seq_len": 9, "rows": [[2, 7], [0, 9]]},
        },
        id="loss-shifted_cp_loss",
    ),
]


def _bits(value: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    value = np.ascontiguousarray(value)
    return str(value.dtype), value.shape, value.tobytes()


@pytest.mark.parametrize("case", CASES)
def test_same_case_twice_is_bit_identical(cp_runner, cp_world_sizes, case):
    if case["world_size"] > max(cp_world_sizes):
        pytest.skip(f"needs world size {case['world_size']}; --cp-world-sizes gives {cp_world_sizes}")
    first = cp_runner.run_outputs(case)
    second = cp_runner.run_outputs(case)
    assert len(first) == len(second) == case["world_size"]
    differences = []
    for a, b in zip(first, second):
        if sorted(a.tensors) != sorted(b.tensors):
            differences.append(f"rank {a.rank}: tensors {sorted(a.tensors)} then {sorted(b.tensors)}")
            continue
        for name in a.tensors:
            if _bits(a.tensors[name]) != _bits(b.tensors[name]):
                x, y = a.tensors[name], b.tensors[name]
                where = np.argwhere(np.asarray(x != y)) if x.shape == y.shape else "shape differs"
                differences.append(
                    f"rank {a.rank}: {name} differs between the runs (at {where[:3].tolist() if isinstance(where, np.ndarray) else where})"
                )
        if a.info != b.info:
            differences.append(f"rank {a.rank}: info {a.info} then {b.info}")
        if a.comm != b.comm:
            differences.append(f"rank {a.rank}: collectives {a.comm} then {b.comm}")
    assert not differences, "the same case gave different results:\n" + "\n".join(differences)
    assert any(o.tensors for o in first), "nothing was returned to compare"
