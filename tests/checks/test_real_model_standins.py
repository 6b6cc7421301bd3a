"""The real-model check on the ring SDPA specs with the CPU stand-in (``cp_harness.standins.ring_sdpa_cpu``):
nemo-automodel 0.7.0's Llama through the framework's default ``shard_batch_load_balanced`` -> torch
``context_parallel`` ring SDPA (``load_balanced_sdpa``: all-gather rotation, ``_alltoall``: torch's all-to-all
rotation), on the session's shared real-model pool.

A small smoke per spec must pass with every parameter gradient judged, the report naming the stand-in; a
gradient-only defect in torch's ring backward (dK/dV never passed on,
``tests/fixtures/real_model_spec_load_balanced_sdpa_dkv_not_passed.py``) must fail on gradients only, and the same
defect judged forward-only must pass. At CP 1 the framework never enters the ring: no stand-in is reported.
Skipped without ``transformers`` (the ``models`` extra).
"""

from __future__ import annotations

import pytest
from real_model_cases import comparison_kinds, real_model_case

from cp_harness.judging.render import report_text

# The subjects whose CP path these tests run and judge (examples/automodel/tools/coverage.py reads it).
JUDGES = ("spec:load_balanced_sdpa", "spec:load_balanced_sdpa_alltoall")

SDPA = "examples.automodel.models.load_balanced_sdpa"
ALLTOALL = "examples.automodel.models.load_balanced_sdpa_alltoall"
DEFECT = "real_model_spec_load_balanced_sdpa_dkv_not_passed"
STANDIN = {"ring_sdpa_cpu": "CPU, stand-in: ring SDPA per-step kernel = "
                            "aten._scaled_dot_product_flash_attention_for_cpu"}

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool




SMOKE = [
    real_model_case(SDPA, "float32", 3, kind="right_padded", seq_len=17, pad=4, batch_size=2, seed=4),
    real_model_case(ALLTOALL, "bfloat16", 2, kind="plain", seq_len=13, seed=5),
    # GQA (2 query heads, 1 key/value head): the CPU flash kernel takes it in float32 too (CUDA's float32
    # memory-efficient kernel does not: docs/models/gpu_only.md)
    {**real_model_case(SDPA, "float32", 2, kind="plain", seq_len=11, seed=3), "overrides": {"num_key_value_heads": 1}},
]


@pytest.mark.parametrize("case", SMOKE, ids=[f"{c['spec'].rsplit('.', 1)[1]}-n{c['world_size']}-{c['dtype']}"
                                             + ("-gqa" if c.get("overrides") else "") for c in SMOKE])
def test_smoke_judges_gradients_on_the_cpu_stand_in(real_models, case):
    report = real_models.run(case)
    assert report.ok, report_text(report)
    assert comparison_kinds(report) == {"logits", "loss", "grad"} and not report.not_judged, report_text(report)
    grads = [c for c in report.comparisons if c.name.startswith("grad ")]
    assert any("k_proj" in c.name for c in grads) and any("q_proj" in c.name for c in grads)
    assert report.standins == STANDIN
    # torch's own rotation ran: K/V all-gathered once (allgather) or passed by all-to-all (alltoall); dK/dV always
    # by all-to-all
    kernels = {call["kernel"] for rank in report.comm for call in rank["calls"]}
    assert "_c10d_functional::all_to_all_single" in kernels, kernels
    assert ("_c10d_functional::all_gather_into_tensor" in kernels) == (case["spec"] == SDPA), kernels


def test_the_stand_in_is_entered_around_the_cp_step_only(real_models):
    """``real_model_spec_load_balanced_sdpa_standin_scope`` raises on any rank where the stand-in is installed
    around a one-device run (the reference, the reordered run), or missing around the CP step (checked to fail
    with the stand-in entered around rank 0's one-device runs)."""
    case = real_model_case("real_model_spec_load_balanced_sdpa_standin_scope", "float32", 2, kind="plain", seq_len=13, seed=5)
    report = real_models.run(case)
    assert report.ok and report.standins == STANDIN, report_text(report)


def test_at_cp_1_the_ring_never_runs_and_no_stand_in_is_reported(real_models):
    report = real_models.run(real_model_case(SDPA, "float32", 1, kind="plain", seq_len=9, seed=2))
    assert report.ok and report.standins == {}, report_text(report)


def test_a_gradient_only_ring_defect_fails_on_gradients_and_passes_forward_only(real_models):
    batch = {"kind": "plain", "seq_len": 13, "seed": 5}
    report = real_models.run(real_model_case(DEFECT, "float32", 2, **batch))
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert failing and all(name.startswith("grad ") for name in failing), report_text(report)
    assert any("k_proj" in name or "v_proj" in name for name in failing), failing
    assert report.standins == STANDIN
    forward_only = real_models.run(real_model_case(f"{DEFECT}_forward_only", "float32", 2, **batch))
    assert forward_only.ok and comparison_kinds(forward_only) == {"logits", "loss"}, report_text(forward_only)
    (what, why), = forward_only.not_judged.items()
    assert "gradients" in what and "forward alone" in why


def test_the_verify_row_and_its_json_name_the_stand_in(real_models):
    from cp_harness.checks.real_model import REAL_MODEL
    from cp_harness.verify.result import format_table
    from cp_harness.verify.rows import Row

    row = Row(spec=REAL_MODEL.rows[0])
    case = SMOKE[0]
    row.tally.add(case, real_models.run(case))
    assert row.as_dict()["standins"] == STANDIN
    assert format_table([row]).splitlines()[-1].endswith("stand-in")


def test_left_padded_rows_fail_under_cp_on_finding_s5_and_pass_at_cp_1(real_models):
    """Finding S5 (docs/real_clients.md): the default path's CP hooks drop the attention mask, so at CP 2 the real
    tokens after a left padding attend it (logits fail from the first real token on, every gradient fails); at CP 1
    (no hooks, the identity sharder keeps the mask) the same batch passes exactly, and the known defect's
    signature and ``when`` name the failure (real_clients calls it documented, not new)."""
    from examples.automodel.tools import defects

    case = real_model_case(SDPA, "float32", 2, kind="left_padded", seq_len=10, pad=3, batch_size=2, seed=0)
    report = real_models.run(case)
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert "logits" in failing and any(n.startswith("grad ") for n in failing), report_text(report)
    logits = next(c for c in report.failures() if c.name.startswith("logits"))
    assert logits.worst_index is not None and logits.worst_index[1] >= 3, logits  # a real position, after the pads
    (s5,) = [d for d in defects.load_defects() if d["id"] == "S5"]
    assert all(defects.holds(row["when"], case) for row in s5["rows"] if row["spec"] == "load_balanced_sdpa")
    assert real_models.run({**case, "world_size": 1}).ok
