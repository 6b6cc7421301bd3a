"""The gate rejects the precision bugs of production CP, and maps where CP adds error in bfloat16.

Each deliberately broken copy under ``tests/fixtures/broken_prec_*`` must fail
the gate, naming the tensor and the measure (the cases used here are explicit
examples of the gate suite, so ``pytest --pyargs cp_harness.tests --cp-impl
...`` fails on them too):

- ``broken_prec_loss_low_sum`` (the loss summed in the logits' bfloat16/float16):
  the loss test, by the float32 ULP budget of the loss (the error is the same
  on one rank, so the excess judge alone could not see it);
- ``broken_prec_grad_bf16_sum`` (a gather backward whose N contributions are
  summed in bfloat16): the gather test, bit for bit, on dyadic upstream
  gradients whose bfloat16 partial sums round;
- ``broken_prec_kv_bf16`` (the CP attention computed from bfloat16 keys and
  values): the float32 and float64 model properties, by the excess over one
  rank (and the budgets); one float32 case here keeps the test short (the
  gathers' bit-exact property rejects it too).

And a halo bug (``broken_gate_halo``) in the bfloat16 Inkling2 model fails by
the excess judge and writes an error map of what CP added over one rank.
"""

from __future__ import annotations

import pytest

from cp_harness.judging.render import verdict_text
from cp_harness.judging.render import report_text
from helpers import check_png, error_maps


@pytest.fixture
def run_case(cp_runner, tmp_path):
    """``run_case(impl, case) -> text``: the case on the session's warm ranks (loading ``impl`` there), judged
    and printed as ``python -m cp_harness run-case --impl IMPL CASE`` prints it; the case must fail."""
    runner = cp_runner.sharing_pool()  # its own counters: broken modules are not examples of the gate

    def run(impl: str, case: dict) -> str:
        if int(case["world_size"]) > runner.config.world_size:
            pytest.skip(f"needs {case['world_size']} ranks (--cp-world-sizes)")
        report = runner.run({**case, "impl": impl})
        out = verdict_text(report, impl, backend=runner.config.backend, error_dir=str(tmp_path / "error-maps"))
        assert not report.ok, out
        assert f"against implementation '{impl}'" in out and "reproduce: python -m cp_harness run-case" in out, out
        return out

    return run


# Explicit examples of the gate suite (cp_harness/tests): `pytest --pyargs cp_harness.tests --cp-impl <fixture>`
# fails on them. One case each, judged on the session's warm ranks, keeps the default command short (no second pytest, no replay of every
# explicit example); test_gate_broken_impls runs the gate suite itself on a broken loss.
LOSS_BF16 = {"check": "shifted_cp_loss", "world_size": 3, "seed": 7, "model": "mistral_large4", "dtype": "bfloat16",
             "vocab": 11, "batch": {"format": "bshd", "seq_len": 20, "rows": [[0, 20], [3, 17]]}}
GATHER_BF16 = {"check": "gather_sequence", "world_size": 3, "seed": 7, "dtype": "bfloat16", "shape": [2, 3, 4],
               "differentiable": True}


def test_the_gate_rejects_a_loss_reduced_in_the_logits_low_precision(run_case):
    out = run_case("broken_prec_loss_low_sum", LOSS_BF16)
    failing = [line for line in out.splitlines() if line.startswith("  FAIL loss")]
    assert len(failing) >= 3, out  # every rank's loss
    # judged as float32 numbers (the contract), whatever the logits' dtype
    assert all("float32" in line and "budget 256 ULP" in line for line in failing), failing


def test_the_gate_rejects_a_gather_backward_that_sums_in_bfloat16(run_case):
    out = run_case("broken_prec_grad_bf16_sum", GATHER_BF16)
    assert "FAIL grad@rank" in out and "[exact, float32" in out, out  # bfloat16 arrives widened, exactly
    assert "output@rank0 (exact)" in out, out  # the forward is right: only the sum is wrong


def test_the_gate_suite_holds_these_cases():
    """The two cases above are explicit examples of the gate suite, so it rejects the fixtures too."""
    from cp_harness.tests import test_loss, test_transport

    def explicit(test):
        return [e.kwargs["case"] for e in test.hypothesis_explicit_examples]

    assert LOSS_BF16 in explicit(test_loss.test_shifted_cp_loss_matches_oracle)
    assert GATHER_BF16 in explicit(test_transport.test_gathers_match_bit_for_bit)


def test_an_attention_fed_bfloat16_keys_fails_the_float32_model_by_its_excess(run_case):
    # The float32 model's gate property with this fixture fails the same way (the float64 one too); one
    # case of it keeps this test short.
    out = run_case("broken_prec_kv_bf16", {
        "check": "model", "world_size": 2, "seed": 12, "model": "mistral_large4", "dtype": "float32",
        "num_chunks": 1, "shard_primary": False,
        "batch": {"format": "bshd", "seq_len": 9, "rows": [[4, 5], [0, 9]]}})
    judged = [line for line in out.splitlines() if line.startswith("  FAIL ") and "one-rank error" in line]
    assert len(judged) >= 10 and all("CP ADDS ERROR" in line for line in judged), out  # both errors named
    assert any(line.startswith("  FAIL logits") for line in judged), out
    assert any(line.startswith("  FAIL grad blocks.0.wk") for line in judged), out
    maps = error_maps(out)
    assert maps, out
    check_png(maps[0])


def test_a_halo_bug_in_the_bfloat16_model_is_mapped_where_cp_adds_error(run_case):
    out = run_case("broken_gate_halo", {
        "check": "model", "world_size": 2, "seed": 3, "model": "inkling2", "dtype": "bfloat16", "num_chunks": 1,
        "batch": {"format": "bshd", "seq_len": 10, "rows": [[0, 10], [2, 8]]}})
    logits = next(line for line in out.splitlines() if line.startswith("  FAIL logits"))
    assert "[ulp, float32" in logits and "bfloat16 ULP" in logits and "CP ADDS ERROR" in logits, logits
    maps = [p for p in error_maps(out) if p.name.endswith("-logits.png")]
    assert maps, out
    check_png(maps[0])


def test_the_payload_policy_accepts_a_gather_backward_summed_in_bfloat16_within_its_bound(cp_runner):
    """The same fixture and case as above: under ``--precision-policy payload`` (partial sums kept in the
    payload's precision, as a backend's reduce-scatter does) it passes, each gradient within N-1 bfloat16 ULPs,
    and the strict policy still rejects it; the correct gather is exact under both."""
    from cp_harness.judging.policy import PAYLOAD, STRICT
    from cp_harness.runner import CaseRunner

    if int(GATHER_BF16["world_size"]) > cp_runner.config.world_size:
        pytest.skip(f"needs {GATHER_BF16['world_size']} ranks (--cp-world-sizes)")
    case = {**GATHER_BF16, "impl": "broken_prec_grad_bf16_sum"}
    payload = CaseRunner(cp_runner.config, pool=cp_runner.pool, policy=PAYLOAD).run(case)
    assert payload.ok, report_text(payload)
    grads = [c for c in payload.comparisons if c.name.startswith("grad@rank")]
    assert grads and all(c.arithmetic and c.budget_ulp == GATHER_BF16["world_size"] - 1 for c in grads)
    assert any(c.max_ulp > 0 for c in grads), [c.max_ulp for c in grads]  # it really rounded in bfloat16
    strict = CaseRunner(cp_runner.config, pool=cp_runner.pool, policy=STRICT).run(case)
    assert not strict.ok and any(c.name.startswith("grad@rank") and not c.ok for c in strict.comparisons)
    correct = CaseRunner(cp_runner.config, pool=cp_runner.pool, policy=PAYLOAD).run(GATHER_BF16)
    assert correct.ok and all(c.max_ulp == 0 for c in correct.comparisons if c.arithmetic)
