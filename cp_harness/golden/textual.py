"""Textual expectations (expecttest) of the golden cases: the halo plan the contract implies and the
collective calls a rank recorded, as readable text."""

from __future__ import annotations


def halo_plan(cp_size: int, local_len: int, width: int) -> list[tuple[int, int, list[int]]]:
    """``convolution_history`` by the contract: ``(src, dst, global rows)`` that rank ``src`` must send ``dst``.

    Rank ``dst`` needs the ``width - 1`` global rows before its shard; rows
    before position 0 are zeros (sent by nobody). The gradient of each row
    travels back the same way (``dst`` to ``src``) in the backward.
    """
    h = width - 1
    plan = []
    for dst in range(cp_size):
        rows = [g for g in range(dst * local_len - h, dst * local_len) if g >= 0]
        for src in range(dst):
            mine = [g for g in rows if src * local_len <= g < (src + 1) * local_len]
            if mine:
                plan.append((src, dst, mine))
    return sorted(plan)


def format_comm(calls: list[dict]) -> str:
    """One rank's recorded collective calls as text: ``op dtype x numel``, in call order."""
    return ", ".join(f"{c['op']} {c['dtype']} x{c['numel']}" for c in calls) or "(none)"
