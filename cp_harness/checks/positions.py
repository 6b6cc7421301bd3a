"""``inkling2.validate_document_positions`` against the SPEC's rule, on every rank.

Every rank validates the same ``keep [B,S]`` and ``positions [B,S]``: the
layout of the case's batch (from the oracle), optionally corrupted in one
place (``case["corruption"]``: ``{"kind", "row", "nth"}``):

- ``offset_start``: the first real span of the row starts at a non-zero
  offset (valid: a shard may begin mid-document);
- ``negative``: a kept position becomes ``-1`` (invalid);
- ``jump``: a kept token right after a kept token skips a position (invalid);
- ``resume``: the first kept token after a gap of padding carries a non-zero
  position (invalid: a gap cannot resume a document).

The verdict comes from ``violations`` below, written from the SPEC text; the
implementation must raise ``ValueError`` naming a violating row and column
exactly when there is one, and on every rank alike.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from cp_harness.cases.descriptions import build_batch
from cp_harness.cases.strategies import as_space, layouts, seeds, world_sizes
from cp_harness.checks import VerifyRow, register
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport
from oracle.layout import layout_from_batch


def violations(keep: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int]]:
    """``(row, column)`` of every kept slot that breaks the SPEC rule for document positions."""
    bad = []
    B, S = keep.shape
    for b in range(B):
        seen_kept = False
        for t in range(S):
            if not keep[b, t]:
                continue
            p = int(positions[b, t])
            if p < 0:
                bad.append((b, t))
            elif t > 0 and keep[b, t - 1]:
                if p not in (int(positions[b, t - 1]) + 1, 0):
                    bad.append((b, t))
            elif seen_kept and p != 0:  # first kept token after a gap of padding
                bad.append((b, t))
            seen_kept = True
    return bad


def case_inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, positions)`` of the case: the oracle's layout, corrupted as the case says."""
    layout = layout_from_batch(build_batch(case))
    keep, positions = layout.keep.clone(), layout.positions.clone()
    corruption = case.get("corruption") or {"kind": "none"}
    kind = corruption["kind"]
    if kind == "none":
        return keep, positions
    row = int(corruption["row"]) % keep.shape[0]
    kept = [t for t in range(keep.shape[1]) if keep[row, t]]
    if not kept:
        return keep, positions
    nth = int(corruption.get("nth", 0))
    if kind == "offset_start":
        first_gap = next((i for i in range(1, len(kept)) if kept[i] != kept[i - 1] + 1), len(kept))
        for t in kept[:first_gap]:
            positions[row, t] += 1 + nth % 5
    elif kind == "negative":
        positions[row, kept[nth % len(kept)]] = -1
    elif kind == "jump":
        after_kept = [t for t in kept if t > 0 and keep[row, t - 1]]
        if after_kept:
            t = after_kept[nth % len(after_kept)]
            positions[row, t] = positions[row, t - 1] + 2
    elif kind == "resume":
        after_gap = [t for i, t in enumerate(kept) if i > 0 and not keep[row, t - 1]]
        if after_gap:
            positions[row, after_gap[nth % len(after_gap)]] = 1 + nth % 3
    else:
        raise ValueError(f"corruption kind {kind!r}; use none, offset_start, negative, jump or resume")
    return keep, positions


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    keep, positions = case_inputs(case)
    before = positions.clone()
    try:
        ctx.impl.inkling2.validate_document_positions(keep.to(ctx.device), positions.to(ctx.device))
        info: dict[str, Any] = {"raised": None, "message": ""}
    except (ValueError, TypeError) as exc:
        info = {"raised": type(exc).__name__, "message": str(exc)}
    info["unchanged"] = bool(torch.equal(before, positions))
    return info, {}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    keep, positions = case_inputs(case)
    bad = violations(keep, positions)
    for o in outputs:
        raised, message = o.info["raised"], o.info["message"]
        report.require(o.info["unchanged"], f"rank {o.rank}: validate_document_positions changed its input")
        if not bad:
            report.require(raised is None, f"rank {o.rank}: valid positions were rejected: {raised}: {message}")
        elif raised != "ValueError":
            report.require(
                False,
                f"rank {o.rank}: positions invalid at (row, column) {bad[:3]} but got "
                f"{raised or 'no error'}{': ' + message if message else ''}",
            )
        else:
            named = any(str(b) in message and str(t) in message and "row" in message.lower() for b, t in bad)
            report.require(
                named,
                f"rank {o.rank}: the ValueError names no violating row and column (violations at {bad[:3]}): {message}",
            )
    # The verdict itself is compared, so that the report is never vacuous.
    verdicts = torch.tensor([o.info["raised"] is not None for o in outputs])
    report.add(
        compare_exact("raised on every rank exactly when invalid", verdicts, torch.full_like(verdicts, bool(bad)))
    )
    report.info["violations"] = len(bad)
    return report


@st.composite
def position_cases(draw, space=None) -> dict:
    """``validate_document_positions`` cases: a layout's positions, valid or corrupted in one place."""
    kind = draw(st.sampled_from(("none", "offset_start", "negative", "jump", "resume")))
    spec = draw(layouts(min_len=1, max_len=24, max_rows=3))
    case = {
        "check": "validate_document_positions",
        "world_size": draw(world_sizes(as_space(space))),
        "seed": draw(seeds),
        "model": "inkling2",
        "batch": spec,
    }
    if kind != "none":
        case["corruption"] = {
            "kind": kind,
            "row": draw(st.integers(min_value=0, max_value=3)),
            "nth": draw(st.integers(min_value=0, max_value=7)),
        }
    return case


# The gate suite's named explicit examples of this check (regressions that must stay).
VALIDATE_DOCUMENT_POSITIONS_EXAMPLES = {
    # a gap must not resume a document
    "n2-thd-resume-seed1": {
        "check": "validate_document_positions",
        "world_size": 2,
        "seed": 1,
        "model": "inkling2",
        "batch": {"format": "thd", "seq_len": 9, "docs": [[[3, 4], [4, 5]]]},
        "corruption": {"kind": "resume", "row": 0, "nth": 0},
    },
    # a shard may begin mid-document
    "n3-bshd-offset_start-seed2": {
        "check": "validate_document_positions",
        "world_size": 3,
        "seed": 2,
        "model": "inkling2",
        "batch": {"format": "bshd", "seq_len": 7, "rows": [[3, 4]]},
        "corruption": {"kind": "offset_start", "row": 0, "nth": 2},
    },
}

VALIDATE_DOCUMENT_POSITIONS = register(
    "validate_document_positions",
    rank=_rank,
    evaluate=_evaluate,
    functions=("inkling2.validate_document_positions",),
    rows=(
        VerifyRow(
            "inkling2.validate_document_positions",
            position_cases,
            ("inkling2.validate_document_positions",),
            position=3,
        ),
    ),
    examples=VALIDATE_DOCUMENT_POSITIONS_EXAMPLES,
)
