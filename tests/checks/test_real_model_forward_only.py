"""The real-model check on the forward-only specs (torch 2.13 has no FlexAttention backward on CPU): nemo-automodel
0.7.0's Kimi Linear and Kimi K3 (MLA over the gathered compressed latent) and Gemma4 MoE (a p2p ring over
``batch_isend_irecv`` with a log-sum-exp merge), tiny configs, on the session's shared real-model pool.

Logits and loss are judged, and the report says it did not judge the gradients, and why. A small smoke per model
must pass; a defect injected into the model's own CP machinery (``tests/fixtures/real_model_spec_<model>_*.py``)
must fail naming logits at the positions it corrupts; Gemma4's one-device packed-mask finding (G2,
``docs/models/gemma4_moe.md``) is pinned. Skipped without ``transformers`` (the ``models`` extra).
"""

from __future__ import annotations


import pytest

from cp_harness.judging.render import report_text

# The subjects whose CP path these tests run and judge (examples/automodel/tools/coverage.py reads it).
JUDGES = ("spec:kimi_linear", "spec:kimi_k3", "spec:gemma4_moe")

KIMI = "examples.automodel.models.kimi_linear"
K3 = "examples.automodel.models.kimi_k3"
GEMMA = "examples.automodel.models.gemma4_moe"

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool


def _case(spec: str, dtype: str, world_size: int, **batch) -> dict:
    return {"check": "real_model", "spec": spec, "dtype": dtype, "seed": 0, "world_size": world_size,
            "batch": batch}


SMOKE = [
    _case(KIMI, "float32", 3, kind="packed", seq_len=19, documents=[[7, 5, 6]], seed=1),
    _case(KIMI, "float32", 2, kind="packed", seq_len=9, documents=[[1, 1, 3, 1, 2]], seed=7),
    _case(K3, "float32", 3, kind="plain", seq_len=19, seed=6),
    _case(GEMMA, "float32", 3, kind="plain", seq_len=19, seed=6),
]


@pytest.mark.parametrize("case", SMOKE, ids=[f"{c['spec'].rsplit('.', 1)[1]}-n{c['world_size']}-{c['batch']['kind']}"
                                             for c in SMOKE])
def test_smoke_judges_logits_and_loss_and_says_what_it_did_not(real_models, case):
    report = real_models.run(case)
    assert report.ok, report_text(report)
    assert {c.name.split(" (")[0] for c in report.comparisons} == {"logits", "loss"}
    (what, why), = report.not_judged.items()
    assert "gradients" in what and "FlexAttention" in why, (what, why)


@pytest.mark.parametrize("fixture,positions", [
    ("real_model_spec_kimi_linear_latent_out_of_order", range(0, 13)),   # every query attends the wrong latent
    ("real_model_spec_gemma4_moe_lse_drops_chunk", range(7, 13)),        # rank >= 1 positions lose earlier chunks
])
def test_a_defect_in_the_models_own_cp_machinery_fails_at_its_positions(real_models, fixture, positions):
    case = _case(fixture, "float32", 2, kind="plain", seq_len=13, seed=5)
    report = real_models.run(case)
    assert not report.ok
    failing = {c.name.split(" (")[0]: c for c in report.failures()}
    assert "logits" in failing and failing["logits"].worst_index[1] in positions, report_text(report)
    assert "vocabulary entry" in report_text(report)


def test_gemma4_eager_packed_masks_are_the_one_device_finding(real_models):
    """G2 (docs/models/gemma4_moe.md): with the recipes' eager attention one device adds the boolean packed mask to
    the scores (no document or causal masking); CP keeps documents apart. When this case passes, the framework
    changed: update the page and known_defects.json."""
    report = real_models.run(_case(GEMMA, "float32", 2, kind="packed", seq_len=12, documents=[[6, 6]], seed=0))
    failing = {c.name.split(" (")[0] for c in report.failures()}
    assert not report.ok and "logits" in failing, report_text(report)
