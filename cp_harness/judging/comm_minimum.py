"""The least communication each documented call needs, to compare with what moved.

Conventions match ``cp_harness.instruments.comm_meter`` (bytes a rank sends; summed over ranks):

- gathers ``[.., L, ..]`` of ``P`` bytes per rank: forward ``(N-1)*P`` per
  rank; differentiable backward the same again (each owner needs the other
  ranks' gradient slices of its shard).
- convolution history of width ``W``: rank ``r`` needs ``min(W-1, r*L)`` rows
  of ``B*C`` elements from the ranks that own them, and sends their
  gradients back.
- shifted loss: one boundary label per row from rank ``r+1`` to rank ``r``
  (``B * itemsize(label)`` bytes; whether that position counts travels in
  the label itself as the ignore index ``-100``, so no separate keep flag is
  needed), plus one all-reduce of the int64 count (``(N-1)*8`` per rank).
- layout and sharding hooks: nothing (every rank holds the global batch).

Validation control messages are counted apart as ``control`` and left out of
the ratio: a small all-gather of integers (at most 32 elements) issued as a
rank's first collective of the call, which is how the bundled implementation
makes mismatched shapes raise on every rank. They are what makes the call
safe, and their size does not grow with the data.

Traffic the meter could not attribute (``unaccounted`` calls, see
``cp_harness.instruments.comm_meter``: an op it has no byte rule for, or a group it cannot
size) has no byte count, so no ratio is made from a report holding any:
``moved_and_minimum`` returns ``None`` for what moved, ``moved`` and
``per_rank_moved`` raise ``UnaccountedCommunication``, and
``unaccounted_ops`` names the ops.

Each check names its pattern (``Check.comm_minimum``: ``gather``, ``halo``,
``boundary_labels``, ``nothing``), which gives the minimum per rank, sent and
received apart (``total`` is the sum of its ``sent`` column); ``per_rank_moved``
reads what each rank of a report sent and received, payload and control
apart. The received minimum is a hard lower bound for every rank (the
bytes it needs from others); the sent minimum is each rank's share of the
same data, whose sum over ranks equals the sum of what the ranks need.
"""

from __future__ import annotations

import numpy as np

CONTROL_MAX_ELEMENTS = 32
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "bool": 1, "int32": 4}


class UnaccountedCommunication(ValueError):
    """A report holds communication the meter could not attribute: its bytes are unknown, not zero."""


def unaccounted_ops(report) -> list[str]:
    """Sorted names of the ops any rank of a report recorded as unaccounted (empty when all were attributed)."""
    return sorted({call["op"] for entry in report.comm for call in entry["calls"] if call.get("unaccounted")})


def _require_accounted(report) -> None:
    ops = unaccounted_ops(report)
    if ops:
        raise UnaccountedCommunication(f"communication the meter could not attribute: {', '.join(ops)}")


def is_control(call: dict, index: int) -> bool:
    """Whether the ``index``-th collective of a rank's call is a validation control message."""
    return (
        index == 0
        and call["op"] == "all_gather"
        and call["dtype"] in ("int64", "int32")
        and call["numel"] <= CONTROL_MAX_ELEMENTS
    )


def moved(report) -> tuple[int, int]:
    """``(payload bytes sent, control bytes sent)`` summed over the ranks of a report (``UnaccountedCommunication``
    when some of it was not attributed)."""
    _require_accounted(report)
    payload = control = 0
    for entry in report.comm:
        for index, call in enumerate(entry["calls"]):
            if is_control(call, index):
                control += call["sent"]
            else:
                payload += call["sent"]
    return payload, control


def total(per_rank: list[tuple[int, int]] | None) -> int | None:
    """Least bytes summed over ranks (the ``sent`` column of a per-rank minimum); ``None``: no closed form."""
    return None if per_rank is None else sum(sent for sent, _ in per_rank)


_NON_FLOAT = ("int64", "int32", "bool")


def _nothing_moves(case: dict) -> bool:
    return int(case["world_size"]) == 1 or case.get("mesh") == "none"


def nothing(case: dict) -> list[tuple[int, int]]:
    """Layout and sharding hooks: every rank holds the global batch, nothing must move."""
    return [(0, 0)] * int(case["world_size"])


def gather(case: dict) -> list[tuple[int, int]]:
    """A gather of local ``shape`` (``value_dtype`` or ``dtype`` payload): ``(N-1)`` shards each way per rank,
    twice when the payload is differentiated (its backward returns every slice to its owner)."""
    if _nothing_moves(case):
        return nothing(case)
    n = int(case["world_size"])
    value_dtype = case.get("value_dtype")
    itemsize = _ITEMSIZE[value_dtype or case.get("dtype", "float64")]
    local = int(np.prod(case["shape"])) * itemsize
    # The gather checks differentiate float payloads unless the case says otherwise (their default is True).
    passes = 2 if case.get("differentiable", True) and value_dtype not in _NON_FLOAT else 1
    return [(passes * (n - 1) * local,) * 2] * n


def halo(case: dict) -> list[tuple[int, int]]:
    """A causal halo of ``width - 1`` rows before each shard of local shape ``[B, L, C]``, and its gradient back."""
    if _nothing_moves(case):
        return nothing(case)
    n = int(case["world_size"])
    B, L, C = (int(x) for x in case["shape"])
    history = int(case["width"]) - 1
    value_dtype = case.get("value_dtype")
    row = B * C * _ITEMSIZE[value_dtype or case.get("dtype", "float64")]
    differentiable = value_dtype not in _NON_FLOAT  # integer/bool payloads: no gradient travels back

    def needs(dst: int, src: int) -> int:  # rows of src's shard inside dst's history
        return max(0, min((src + 1) * L, dst * L) - max(dst * L - history, src * L))

    out = []
    for r in range(n):
        incoming = sum(needs(r, s) for s in range(r))  # = min(history, r * L)
        outgoing = sum(needs(d, r) for d in range(r + 1, n))
        # Forward: rows in, own rows out; backward: their gradients the other way.
        if differentiable:
            out.append(((incoming + outgoing) * row, (incoming + outgoing) * row))
        else:
            out.append((outgoing * row, incoming * row))
    return out


def boundary_labels(case: dict) -> list[tuple[int, int]]:
    """A shifted loss: rank ``r`` gets one label per row from ``r+1``, and every rank learns every count."""
    if _nothing_moves(case):
        return nothing(case)
    n = int(case["world_size"])
    rows = len(case["batch"]["docs"] if case["batch"]["format"] == "thd" else case["batch"]["rows"])
    label, count = rows * 8, (n - 1) * 8
    return [((label if r > 0 else 0) + count, (label if r < n - 1 else 0) + count) for r in range(n)]


def per_rank_moved(report) -> list[dict[str, int]]:
    """Per rank of a report: ``{"rank", "sent", "recv", "control_sent", "control_recv", "calls"}`` (payload apart
    from control; ``UnaccountedCommunication`` when some of it was not attributed)."""
    _require_accounted(report)
    out = []
    for entry in report.comm:
        row = {
            "rank": int(entry["rank"]),
            "sent": 0,
            "recv": 0,
            "control_sent": 0,
            "control_recv": 0,
            "calls": len(entry["calls"]),
        }
        for index, call in enumerate(entry["calls"]):
            prefix = "control_" if is_control(call, index) else ""
            row[prefix + "sent"] += int(call["sent"])
            row[prefix + "recv"] += int(call["recv"])
        out.append(row)
    return out


def moved_and_minimum(report, per_rank_minimum: list[tuple[int, int]] | None) -> tuple[int | None, int]:
    """``(payload moved, minimum)`` for the verify table, given the check's per-rank minimum of the report's
    case; calls without a closed form (the models) contribute to neither.

    Payload moved is ``None`` when the report holds unaccounted communication (``unaccounted_ops``):
    its bytes are unknown, and a ratio made from the rest would be wrong.
    """
    need = total(per_rank_minimum)
    if unaccounted_ops(report):
        return None, need or 0
    if need is None:
        return 0, 0
    payload, _ = moved(report)
    return payload, need
