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

Errors are in ULPs of the comparison's own measure (``cp_harness.compare``:
element ``i`` relative to ``max(|expected_i|, floor_fraction x scale)``, the
baseline error being its largest over the tensor). The floor is ``k`` ULPs
*at the tensor's scale*, an absolute error of ``k x eps x scale`` whatever
the element it lands on; in element ``i``'s measure that is
``k x scale / max(|expected_i|, floor_fraction x scale)`` ULPs: ``k`` at the
largest elements, ``k / floor_fraction`` at the floor. So element ``i``
passes when ``ulp_i <= c x baseline + floor_i``, and the tensor's excess is
``max_i ulp_i / (baseline + floor_i / c)``.

``c`` and ``floor`` are per (check, dtype) in ``RULES`` (figures behind
them: ``cp_harness.budgets`` and the README). The reported **CP excess** is
``CP error / (baseline error + floor / c)``: the ratio of the two errors, with
the baseline floored so that an exact baseline does not give infinity; a
tensor fails when its excess is above ``c``.

Tensors are paired by name; a rank's own loss (``loss@rank<r> ...``) is
paired with the one rank's loss (``loss@rank0 ...``). A case of one rank is
its own baseline and is judged by its ULP budget alone. The ULP budgets still
apply beside this judge (both must pass): the budget catches an error that is
the same at every CP size (a loss reduced in bfloat16 everywhere, which the
excess judge cannot see), the excess judge catches what CP adds where a
budget is loose or cannot be stated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from cp_harness.cases import LOW_PRECISION

ARITHMETIC_CHECKS = ("shifted_cp_loss", "model")


@dataclasses.dataclass(frozen=True)
class ExcessRule:
    """``limit``: the factor ``c``; ``floor``: ULPs CP may add over an exact baseline."""

    limit: float
    floor: float


# Placeholder until measured (see README "Error budgets").
RULES: dict[tuple[str, str], ExcessRule] = {
    (check, dtype): ExcessRule(math.inf, 0.0)
    for check in ARITHMETIC_CHECKS for dtype in ("float64", "float32", *LOW_PRECISION)
}


def rule_for(case: dict) -> ExcessRule:
    key = (case["check"], case.get("dtype", "float64"))
    if key not in RULES:
        raise KeyError(f"no excess rule for {key}; add one to cp_harness.excess.RULES")
    return RULES[key]


def baseline_case(case: dict) -> dict | None:
    """The one-rank run that ``case`` is judged against, or ``None`` (not arithmetic, or already one rank).

    Same description with ``world_size = 1`` (a mesh of size one). The loss check draws its logits for
    the sequence padded to a multiple of the CP size: ``pad_multiple`` keeps the CP case's logits.
    """
    if case.get("check") not in ARITHMETIC_CHECKS or int(case.get("world_size", 1)) <= 1:
        return None
    base = {k: v for k, v in case.items() if k != "mesh"}
    base["world_size"] = 1
    if case["check"] == "shifted_cp_loss":
        base["pad_multiple"] = int(case.get("pad_multiple", case["world_size"]))
    return base


def baseline_name(name: str) -> str:
    """Name of the one-rank comparison a CP comparison is paired with."""
    if name.startswith("loss@rank"):
        return "loss@rank0" + name[name.index(" "):] if " " in name else "loss@rank0"
    return name


def element_terms(comp, floor_ulp: float, fraction: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ulp_i, floor_i)`` of a ULP comparison: each element's error and the floor of ``floor_ulp`` ULPs at the
    tensor's scale, both in the measure with floor ``fraction`` (default: the comparison's own)."""
    from cp_harness.compare import eps_of

    fraction = comp.floor_fraction if fraction is None else fraction
    actual, expected = (np.asarray(x, dtype=np.float64) for x in comp.element_values)
    unit = np.maximum(np.abs(expected), max(comp.scale * fraction, np.finfo(np.float64).tiny))
    with np.errstate(invalid="ignore", over="ignore"):
        ulp = np.abs(actual - expected) / (eps_of(comp.ulp_dtype) * unit)
    ulp = np.where(np.isnan(ulp) | (np.isnan(actual) != np.isnan(expected)), np.inf, ulp)
    ulp = np.where(np.isnan(actual) & np.isnan(expected), 0.0, ulp)
    if comp.ulp_values is not None:  # zero outside the comparison's selection (and where exact)
        ulp = comp.ulp_values if fraction == comp.floor_fraction else np.where(comp.ulp_values == 0, 0.0, ulp)
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


def apply(report, baseline_report, rule: ExcessRule | None = None) -> None:
    """Judge every ULP comparison of ``report`` against its counterpart in ``baseline_report`` (in place)."""
    rule = rule or rule_for(report.case)
    reference = {c.name: c for c in baseline_report.comparisons if c.mode == "ulp"}
    for comp in report.comparisons:
        ref = reference.get(baseline_name(comp.name)) if comp.mode == "ulp" else None
        if ref is None or comp.compared == 0:
            continue
        base = ref.max_ulp if math.isfinite(ref.max_ulp) else 0.0  # a failed baseline earns CP no allowance
        comp.baseline_ulp = base
        comp.excess_limit, comp.excess_floor = rule.limit, rule.floor
        ulp, floor = element_terms(comp, rule.floor)
        comp.excess = max_excess(ulp, floor, base, rule.limit)
        if comp.excess_failed:
            _locate_excess(comp, ref, rule.limit * base + floor)


def _locate_excess(comp, ref, allowance: np.ndarray) -> None:
    """Count the elements above the allowance and, for a token-aligned tensor, map where CP added error."""
    if comp.ulp_values is None:
        return
    cp = np.where(np.isfinite(comp.ulp_values), comp.ulp_values, np.inf)
    over = cp > allowance
    comp.excess_mismatched = int(over.sum())
    pair = _aligned(cp, ref.ulp_values) if ref.ulp_values is not None else None
    added = np.where(over, cp, 0.0)
    if pair is not None:
        cp_part, base_part = pair
        over_part = over[tuple(slice(0, s) for s in cp_part.shape)]
        added = np.zeros_like(cp)
        added[tuple(slice(0, s) for s in cp_part.shape)] = np.where(
            over_part, np.maximum(cp_part - np.nan_to_num(base_part, nan=0.0, posinf=0.0), 0.0), 0.0)
    if not comp.first_mismatches and comp.element_values is not None:
        actual, expected = comp.element_values
        order = np.argsort(-np.where(over, cp, -1.0), axis=None)[:comp.excess_mismatched][:5]
        for flat in order:
            idx = tuple(int(i) for i in np.unravel_index(int(flat), cp.shape))
            entry = {"index": list(idx), "actual": float(actual[idx]), "expected": float(expected[idx]),
                     "ulp": float(cp[idx])}
            if comp.grid is not None and cp.ndim >= 2:
                entry.update(comp.grid.describe(idx[0], idx[1]))
            comp.first_mismatches.append(entry)
    if cp.ndim >= 2 and comp.grid is not None:
        per = added
        if per.ndim > 2:
            per = per.reshape(per.shape[0], per.shape[1], -1).max(axis=-1)
        comp.error_map = per
        comp.error_map_unit = "CP error minus one-rank error (ULP)"
