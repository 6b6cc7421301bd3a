"""The least communication each documented call needs, to compare with what moved.

Conventions match ``cp_harness.comm`` (bytes a rank sends; summed over ranks):

- gathers ``[.., L, ..]`` of ``P`` bytes per rank: forward ``(N-1)*P`` per
  rank; differentiable backward the same again (each owner needs the other
  ranks' gradient slices of its shard).
- convolution history of width ``W``: rank ``r`` needs ``min(W-1, r*L)`` rows
  of ``B*C`` elements from the ranks that own them, and sends their
  gradients back.
- shifted loss: one boundary label and keep flag per row from rank ``r+1``
  to rank ``r`` (``B * (itemsize(label) + 1)`` bytes), plus one all-reduce of
  the int64 count (``(N-1)*8`` per rank).
- layout and sharding hooks: nothing (every rank holds the global batch).

Validation control messages are counted apart as ``control`` and left out of
the ratio: a small all-gather of integers (at most 32 elements) issued as a
rank's first collective of the call, which is how the bundled implementation
makes mismatched shapes raise on every rank. They are what makes the call
safe, and their size does not grow with the data.
"""

from __future__ import annotations

import numpy as np

CONTROL_MAX_ELEMENTS = 32
_ITEMSIZE = {"float64": 8, "float32": 4, "int64": 8, "bool": 1, "int32": 4}


def is_control(call: dict, index: int) -> bool:
    """Whether the ``index``-th collective of a rank's call is a validation control message."""
    return (index == 0 and call["op"] == "all_gather" and call["dtype"] in ("int64", "int32")
            and call["numel"] <= CONTROL_MAX_ELEMENTS)


def moved(report) -> tuple[int, int]:
    """``(payload bytes sent, control bytes sent)`` summed over the ranks of a report."""
    payload = control = 0
    for entry in report.comm:
        for index, call in enumerate(entry["calls"]):
            if is_control(call, index):
                control += call["sent"]
            else:
                payload += call["sent"]
    return payload, control


def minimum(case: dict) -> int | None:
    """Least bytes (summed over ranks) the case's documented call must send; ``None`` when not defined (models)."""
    n = int(case["world_size"])
    if n == 1 or case.get("mesh") == "none":
        return 0
    check = case["check"]
    if check in ("gather_sequence", "gather_tokens"):
        itemsize = _ITEMSIZE[case.get("value_dtype") or case.get("dtype", "float64")]
        local = int(np.prod(case["shape"])) * itemsize
        per_rank = (n - 1) * local
        return n * per_rank * (2 if case.get("differentiable") and not case.get("value_dtype") else 1)
    if check == "convolution_history":
        B, L, C = case["shape"]
        rows = sum(min(int(case["width"]) - 1, r * L) for r in range(n))
        return 2 * rows * B * C * _ITEMSIZE[case.get("dtype", "float64")]
    if check == "shifted_cp_loss":
        rows = len(case["batch"]["docs"] if case["batch"]["format"] == "thd" else case["batch"]["rows"])
        return (n - 1) * rows * (8 + 1) + n * (n - 1) * 8
    if check.endswith("_layout"):
        return 0
    return None


def moved_and_minimum(case: dict, report) -> tuple[int, int]:
    """``(payload moved, minimum)`` for the verify table; models contribute to neither (no closed form)."""
    need = minimum(case)
    if need is None:
        return 0, 0
    payload, _ = moved(report)
    return payload, need
