"""The excess judge: how much error CP adds over one rank of the same implementation.

A ULP budget measured on one implementation says how far that implementation
strays; it cannot tell a correct implementation that rounds differently from
a broken one, and in bfloat16/float16 no fixed budget separates the model's
own rounding from what CP adds. So every arithmetic case of ``N > 1`` ranks
is also run on **one rank** of the same implementation (``world_size = 1``,
same dtype, same inputs, same micro-batching: ``baseline_case``), both are
compared with the same float64 oracle in the same measure, and each tensor
must satisfy::

    CP error <= c * baseline error + floor

Both errors are measured **normwise**, whatever the measure of the tensor's
ULP budget: ``max_i |actual_i - expected_i| / (eps x scale)``, the scale
being the tensor's largest expected magnitude (or its family's, e.g. the
model's largest parameter gradient). In an element-wise measure the one-rank
error is set by the tiny elements that cancellation makes inaccurate
(hundreds of ULPs of themselves in float32 and bfloat16), and ``c`` times
that would be allowed on the large elements too; normwise, the one-rank error
is a few ULPs and the allowance stays tight on every element. Small elements
keep their element-wise float64 budget beside this judge. The floor is ``k``
ULPs at the tensor's scale: what the SPEC's per-rank scaling
(``local_sum x N / count``) and the average over ranks round even when
nothing is reordered.

The reported **CP excess** is
``CP error / (baseline error + k / c)``: the ratio of the two errors, with
the baseline floored so that an exact baseline does not give infinity; a
tensor fails when its excess is above ``c``.

Tensors are paired by name. A rank's own tensor (``Comparison.rank`` set: a
rank's loss, its partial sum x N / global count) has no one-rank counterpart: one rank holds
the whole sum, and a partial sum of cross-entropies whose absolute error is
set by the logits (``logsumexp - picked``) is no like-for-like match for it
(measured: 57 float32 ULPs on a rank where the one-rank loss had 6, with
every other tensor of those runs within 1x + 2 ULP). Per-rank losses are
judged by their ULP budget, which is there for their scaling (``N / count``
errors are O(1)); the mean over ranks is paired with the one-rank loss. A
case of one rank is its own baseline and is judged by its ULP budget alone. The ULP budgets still
apply beside this judge (both must pass): the budget catches an error that is
the same at every CP size (a loss reduced in bfloat16 everywhere, which the
excess judge cannot see), the excess judge catches what CP adds where a
budget is loose or cannot be stated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from cp_harness.judging.compare import ExcessVerdict, eps_of, ulp_errors
from cp_harness.judging.policy import ExcessRule

# The rule (c and the floors) is the judging policy's (``cp_harness.judging.policy``); which checks are
# arithmetic and what their one-rank baseline is, the check's (``Check.arithmetic``, ``Check.baseline_case``).


def pairs_with_baseline(comp) -> bool:
    """Whether an arithmetic comparison has a one-rank counterpart: global tensors do, a rank's own tensor
    (``comp.rank`` set, e.g. its loss) does not (see the module docstring)."""
    return comp.arithmetic and comp.rank is None


def element_terms(comp, floor_ulp: float, fraction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(ulp_i, floor_i)`` of a ULP comparison: each element's error and the floor of ``floor_ulp`` ULPs at the
    tensor's scale, both in the measure with floor ``fraction`` (default 1: normwise, the judge's measure)."""
    actual, expected = (np.asarray(x, dtype=np.float64) for x in comp.element_values)
    unit = np.maximum(np.abs(expected), max(comp.scale * fraction, np.finfo(np.float64).tiny))
    ulp = ulp_errors(actual, expected, eps_of(comp.ulp_dtype), unit)
    if comp.ulp_values is not None:  # zero outside the comparison's selection (and where exact)
        ulp = np.where(comp.ulp_values == 0, 0.0, ulp)
    return ulp, floor_ulp * comp.scale / unit


def max_excess(ulp: np.ndarray, floor: np.ndarray, baseline: float, limit: float) -> float:
    """``max_i ulp_i / (baseline + floor_i / limit)``: at most ``limit`` iff every ``ulp_i <= limit x baseline + floor_i``."""
    if ulp.size == 0:
        return 0.0
    denominator = baseline + (floor / limit if math.isfinite(limit) else 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(ulp == 0, 0.0, ulp / denominator)
    return float(np.max(np.where(np.isnan(ratio), np.inf, ratio)))


def needed_limit(ulp: np.ndarray, floor: np.ndarray, baseline: float) -> float:
    """The smallest ``c`` with ``ulp_i <= c x baseline + floor_i`` for every element (calibration)."""
    over = ulp > floor
    if not over.any():
        return 0.0
    if baseline <= 0:
        return math.inf
    return float(np.max((ulp[over] - floor[over]) / baseline))


def _aligned(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The common part of two per-element arrays that differ at most in their sequence length (axis 1)."""
    if a.shape == b.shape:
        return a, b
    if a.ndim >= 2 and a.ndim == b.ndim and a.shape[0] == b.shape[0] and a.shape[2:] == b.shape[2:]:
        n = min(a.shape[1], b.shape[1])
        return a[:, :n], b[:, :n]
    return None


def apply(report, baseline_report, rule: ExcessRule) -> None:
    """Judge every ULP comparison of ``report`` against its counterpart in ``baseline_report`` (in place): each
    gets an ``ExcessVerdict`` (``comp.excess``)."""
    reference = {c.name: c for c in baseline_report.comparisons if pairs_with_baseline(c)}
    for comp in report.comparisons:
        ref = reference.get(comp.name) if pairs_with_baseline(comp) else None
        if ref is None or comp.compared == 0:
            continue
        ulp, floor = element_terms(comp, rule.floor)
        base_ulp, _ = element_terms(ref, 0.0)
        base = float(base_ulp.max()) if base_ulp.size else 0.0
        base = base if math.isfinite(base) else 0.0  # a failed baseline earns CP no allowance
        comp.excess = ExcessVerdict(
            error=float(ulp.max()) if ulp.size else 0.0,
            baseline=base,
            excess=max_excess(ulp, floor, base, rule.limit),
            limit=rule.limit,
            floor=rule.floor,
        )
        if comp.excess.failed:
            _locate_excess(comp, base_ulp, rule.limit * base + floor)


def _locate_excess(comp, base_ulp: np.ndarray, allowance: np.ndarray) -> None:
    """Count the elements above the allowance and, for a token-aligned tensor, map where CP added error."""
    cp, _ = element_terms(comp, 0.0)
    over = cp > allowance
    comp.excess = dataclasses.replace(comp.excess, mismatched=int(over.sum()))
    pair = _aligned(cp, base_ulp)
    added = np.where(over, cp, 0.0)
    if pair is not None:  # what CP added over one rank, element by element (the common sequence length)
        cp_part, base_part = pair
        part = tuple(slice(0, n) for n in cp_part.shape)
        added = np.zeros_like(cp)
        added[part] = np.where(
            over[part], np.maximum(cp_part - np.where(np.isfinite(base_part), base_part, 0.0), 0.0), 0.0
        )
    if not comp.first_mismatches and comp.element_values is not None:
        actual, expected = comp.element_values
        order = np.argsort(-np.where(over, cp, -1.0), axis=None)[: min(comp.excess.mismatched, 5)]
        for flat in order:
            idx = tuple(int(i) for i in np.unravel_index(int(flat), cp.shape))
            entry = {
                "index": list(idx),
                "actual": float(actual[idx]),
                "expected": float(expected[idx]),
                "ulp": float(cp[idx]),
            }
            if comp.grid is not None and cp.ndim >= 2:
                entry.update(comp.grid.describe(idx[0], idx[1]))
            comp.first_mismatches.append(entry)
    if cp.ndim >= 2 and comp.grid is not None:
        per = added
        if per.ndim > 2:
            per = per.reshape(per.shape[0], per.shape[1], -1).max(axis=-1)
        comp.error_map = per
        comp.error_map_unit = "CP error minus one-rank error (normwise ULP)"
