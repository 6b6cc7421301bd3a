"""The excess judge (``cp_harness.judging.excess``) and the low-precision contract helpers, without a rank pool.

- A tensor passes when its CP error is at most ``c`` x the one-rank error plus ``k`` ULPs at its scale,
  and fails above; the message names both errors.
- A factor-of-two error on a small bfloat16 tensor fails, where a fixed ``atol`` of 2.5e-2 (the
  anchors' kind of tolerance) sees nothing.
- An exact or failed (non-finite) one-rank run earns CP nothing but the floor.
- The error map of an excess failure is where CP added error, in global token order.
- The one-rank case is the same description on one rank; the loss keeps the CP case's logits.
- bfloat16/float16 upstream gradients: float32 sums exact in any order, low-precision partial sums not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_harness import checks
from cp_harness.judging import excess
from cp_harness.cases.descriptions import EPS, accumulate, upstream_values
from cp_harness.judging.verdicts import CaseReport
from cp_harness.checks.loss import loss_inputs
from cp_harness.judging.compare import TokenGrid, compare_ulp
from cp_harness.judging.policy import ExcessRule
from cp_harness.judging.render import comparison_summary, report_text

RULE = ExcessRule(limit=2.0, floor=2.0)


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _judge(expected, cp, one_rank, *, dtype="bfloat16", grid=None, name="t", rule=RULE):
    case = {"check": "model", "world_size": 2, "dtype": dtype}
    report, base = CaseReport(case=case), CaseReport(case=dict(case, world_size=1))
    report.add(compare_ulp(name, cp, expected, budget_ulp=math.inf, floor_fraction=1.0, ulp_dtype=dtype,
                       grid=grid))
    base.add(compare_ulp(name, one_rank, expected, budget_ulp=math.inf,
                     floor_fraction=1.0, ulp_dtype=dtype))
    excess.apply(report, base, rule)
    return report.comparisons[0]


def test_within_c_times_the_one_rank_error_plus_the_floor_passes_and_above_fails():
    expected = np.linspace(-1.0, 1.0, 64)
    eps = EPS["bfloat16"]
    one_rank = expected + 3 * eps * np.sign(expected)  # 3 ULP normwise
    ok = _judge(expected, expected + (2 * 3 + 2) * eps * 0.99, one_rank)
    assert ok.ok and ok.excess.baseline == pytest.approx(3.0) and ok.excess.excess <= RULE.limit
    bad = _judge(expected, expected + (2 * 3 + 2) * eps * 1.05, one_rank)
    assert not bad.ok and bad.excess.excess > RULE.limit and bad.excess.mismatched > 0
    text = comparison_summary(bad)
    assert "one-rank error 3" in text and "CP error 8.4" in text and "CP ADDS ERROR" in text, text


def test_a_factor_of_two_on_a_small_bf16_tensor_fails_where_a_fixed_atol_sees_nothing():
    g = np.random.default_rng(0)
    expected = g.normal(size=(2, 6, 3)) * 1e-3
    one_rank = _bf16(expected)
    cp = _bf16(expected * 2)  # e.g. a gradient counted twice
    assert np.allclose(cp, expected, atol=2.5e-2, rtol=0)  # the anchors' tolerance passes it
    comp = _judge(expected, cp, one_rank)
    assert not comp.ok and comp.excess.excess > 20 * RULE.limit  # about 128 ULP at the tensor's scale


def test_an_exact_one_rank_run_leaves_only_the_floor():
    expected = np.array([1.0, -0.5, 0.25])
    eps = EPS["float64"]
    assert _judge(expected, expected + 1.9 * eps, expected, dtype="float64").ok
    comp = _judge(expected, expected + 2.5 * eps, expected, dtype="float64")
    assert not comp.ok and comp.excess.baseline == 0.0


def test_a_one_rank_run_that_is_not_finite_earns_no_allowance():
    expected = np.array([1.0, 2.0])
    comp = _judge(expected, expected * (1 + 5e-2), np.array([np.nan, 2.0]))  # 6.4 ULP: above the floor
    assert comp.excess.baseline == 0.0 and not comp.ok


def test_the_error_map_shows_where_cp_added_error():
    B, S, L = 2, 8, 4
    expected = np.random.default_rng(1).normal(size=(B, S, 5))
    one_rank = _bf16(expected)
    cp = one_rank.copy()
    cp[1, L] *= 1.5  # the first token of rank 1's shard: a boundary bug
    comp = _judge(expected, cp, one_rank, grid=TokenGrid(L, 2), name="logits")
    assert not comp.ok and comp.error_map is not None and comp.error_map.shape == (B, S)
    assert set(zip(*np.nonzero(comp.error_map))) == {(1, L)}
    assert comp.error_map_unit.startswith("CP error minus one-rank error")
    assert comp.first_mismatches[0]["owning_rank"] == 1 and comp.first_mismatches[0]["at_shard_boundary"]


def test_a_ranks_own_loss_has_no_one_rank_counterpart():
    """Paired by role, not by name: a comparison of one rank's tensor (``rank`` set) has no one-rank twin."""
    expected = np.array([1.0, 2.0])
    own = compare_ulp("loss (local sum x N / global count)", expected, expected, budget_ulp=4.0, rank=3)
    whole = compare_ulp("loss (local sum x N / global count)", expected, expected, budget_ulp=4.0)
    assert not excess.pairs_with_baseline(own) and excess.pairs_with_baseline(whole)


def test_the_one_rank_case_is_the_same_description_on_one_rank():
    case = {"check": "model", "world_size": 4, "mesh": "mesh", "seed": 3, "dtype": "bfloat16", "num_chunks": 2}
    assert checks.check_of(case).baseline_case(case) == {"check": "model", "world_size": 1, "seed": 3, "dtype": "bfloat16",
                                          "num_chunks": 2}
    assert checks.check_of(case).baseline_case(dict(case, world_size=1)) is None
    tokens = {"check": "gather_tokens", "world_size": 4}
    assert checks.check_of(tokens).baseline_case(tokens) is None
    loss = {"check": "shifted_cp_loss", "world_size": 3, "seed": 5, "model": "mistral_large4", "dtype": "bfloat16",
            "vocab": 7, "batch": {"format": "bshd", "seq_len": 7, "rows": [[1, 5], [0, 7]]}}
    one = checks.check_of(loss).baseline_case(loss)
    assert one["world_size"] == 1 and one["pad_multiple"] == 3
    logits, labels, keep, _ = loss_inputs(loss)
    logits1, labels1, keep1, _ = loss_inputs(one)
    assert torch.equal(logits, logits1) and torch.equal(labels, labels1) and torch.equal(keep, keep1)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 16), dtype=st.sampled_from(["bfloat16", "float16"]))
def test_low_precision_upstream_gradients_sum_exactly_in_float32(seed, n, dtype):
    case = {"seed": seed, "dtype": dtype}
    parts = [upstream_values(case, f"upstream{r}", (64,)) for r in range(n)]
    exact = sum(p.to(torch.float64) for p in parts)
    forward = accumulate(parts, parts[0].dtype)
    backward = accumulate(parts[::-1], parts[0].dtype)
    assert torch.equal(forward, backward) and torch.equal(forward, exact.to(parts[0].dtype))


def test_low_precision_partial_sums_round_where_the_contract_does_not():
    parts = [upstream_values({"seed": 1, "dtype": "bfloat16"}, f"upstream{r}", (256,)) for r in range(3)]
    sequential = parts[0] + parts[1] + parts[2]  # bfloat16 partial sums
    assert not torch.equal(sequential, accumulate(parts, torch.bfloat16))


def _one_rank_loss_report(impl, case):
    """Run the loss check's rank half in this process (one rank, no mesh) and judge it."""
    from cp_harness import checks
    from cp_harness.ranks.pool import RankOutput

    ctx = checks.RankContext(rank=0, cp_size=1, mesh=None, device=torch.device("cpu"), backend="gloo", impl=impl)
    info, tensors = checks.run_on_rank(dict(case, mesh="none"), ctx)
    return checks.evaluate(case, [RankOutput(rank=0, ok=True, info=info, tensors=tensors, comm=[], seconds=0.0)])


def test_a_cross_entropy_computed_as_logsumexp_minus_picked_is_no_false_alarm(monkeypatch):
    """A confident single target: the loss is 0.002 and rounds at the log-sum-exp's scale (2e-16 absolute).

    Judged relative to its own value (the scale the float64 loss had before) the correct second
    implementation was 396 / 482 ULP off the 16-ULP budget; at its rounding scale it passes."""
    import importlib
    import sys
    from pathlib import Path

    from cp_harness.checks import loss as loss_check

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "fixtures"))
    alt = importlib.import_module("alt_reduction_order")
    case = {"batch": {"docs": [[[1, 1]], [[1, 1]], [[2, 2]]], "format": "thd", "seq_len": 2},
            "check": "shifted_cp_loss", "dtype": "float64", "model": "mistral_large4", "seed": 6434, "vocab": 3,
            "world_size": 1}
    report = _one_rank_loss_report(alt, case)
    assert report.ok, report_text(report)
    # The same run judged at the loss's own scale and the gradient's own largest value fails: the test can fail.
    monkeypatch.setattr(loss_check, "cross_entropy_scale", lambda *a, **k: 0.0)
    original = loss_check.compare_ulp

    def own_scale(name, *args, **kwargs):
        kwargs.pop("reference_scale", None)
        return original(name, *args, **kwargs)

    monkeypatch.setattr(loss_check, "compare_ulp", own_scale)
    before = _one_rank_loss_report(alt, case)
    assert {c.name for c in before.failures()} >= {"loss (mean over ranks)", "d loss / d logits"}, report_text(before)
    assert "alt_reduction_order" in sys.modules
