"""The real-model check on ``glm_moe_dsa`` (nemo-automodel 0.7.0's GLM-5.2 DSA: the model-owned packed THD CP of
``glm_moe_dsa/cp.py``, the K/V all-gathers inside the model) on a CPU, through the stand-in ``glm_dsa_kernels_cpu``
(TileLang's lighting indexer and sparse MLA computed in torch, in the CP step and the one-device runs alike: there
is no CPU kernel), on the session's shared real-model pool.

A small smoke must pass with every parameter gradient judged and the stand-in named: a packed row whose first
document is longer than ``index_topk`` (64: the indexer selects, across shard boundaries, with CP padding between
the documents: ``cu_seqlens_padded``) at CP 2. A gradient-only defect in the K/V all-gather's backward
(``tests/fixtures/real_model_spec_glm_moe_dsa_kv_gather_grad_not_reduced.py``, forward untouched) must fail on
gradients only, naming the latent K/V projection, and the same fixture judged forward-only must pass.
"""

from __future__ import annotations

import pytest
from real_model_cases import comparison_kinds, real_model_case

from cp_harness.judging.render import report_text

# The subjects whose CP path these tests run and judge (examples/automodel/tools/coverage.py reads it).
JUDGES = ("spec:glm_moe_dsa",)

GLM = "examples.automodel.models.glm_moe_dsa"
DEFECT = "real_model_spec_glm_moe_dsa_kv_gather_grad_not_reduced"
STANDIN = {
    "glm_dsa_kernels_cpu": "CPU, stand-in: DSA lighting-indexer and sparse-MLA kernels = torch on the CPU (float32 "
    "relu(q.k)*w logits in the key windows; gathered top-k softmax attention with base-2 LSE and its saved-LSE "
    "backward)"
}
PACKED = {"kind": "packed", "seq_len": 100, "documents": [[70, 29]], "seed": 3}

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool


def test_smoke_selecting_packed_row_judges_every_gradient(real_models):
    report = real_models.run(real_model_case(GLM, "bfloat16", 2, **PACKED))
    assert report.ok, report_text(report)
    assert comparison_kinds(report) == {"logits", "loss", "grad"} and not report.not_judged, report_text(report)
    assert report.standins == STANDIN, report.standins
    grads = {c.name.split(" (")[0] for c in report.comparisons if c.name.startswith("grad ")}
    assert any("self_attn.kv_a_proj_with_mqa" in name for name in grads), sorted(grads)


@pytest.mark.parametrize("forward_only", [False, True], ids=["judged", "forward-only"])
def test_a_gradient_only_kv_gather_defect_fails_on_gradients_and_passes_forward_only(real_models, forward_only):
    # one document over both ranks (12 tokens each): rank 1's queries attend rank 0's keys too, and rank 0 gets
    # their part of those keys' gradient only through the all-gather's backward
    batch = {"kind": "plain", "seq_len": 24, "seed": 1}
    if forward_only:
        report = real_models.run(real_model_case(f"{DEFECT}_forward_only", "bfloat16", 2, **batch))
        assert report.ok and comparison_kinds(report) == {"logits", "loss"}, report_text(report)
        ((what, why),) = report.not_judged.items()
        assert "gradients" in what and "gradient-only defect" in why, (what, why)
        return
    report = real_models.run(real_model_case(DEFECT, "bfloat16", 2, **batch))
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert failing and all(name.startswith("grad ") for name in failing), report_text(report)
    assert any("kv_a_proj_with_mqa" in name for name in failing), sorted(failing)
    assert report.standins == STANDIN
