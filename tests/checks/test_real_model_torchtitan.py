"""torchtitan 0.3.0 as the gate's second real client (docs/torchtitan.md): its llama3 at a tiny config through its CP
entry (``apply_cp_to_forward`` on FlexAttention, ``prepare_context_parallel_input`` with the head-tail and PTRR load
balancers and document block masks), judged by the ``real_model`` check against one device on the session's shared
real-model pool (3 gloo ranks).

A smoke per balancer must pass with every parameter gradient judged on the stand-in ``flex_backward_cpu_all_runs``;
each defect fixture (a balancer's chunk order swapped on one rank, the unshard in reversed rank order, the K/V
all-gather in reversed rank order, dK/dV not reduce-scattered: gradients only) must fail naming what it corrupts.
Rows of 250-380 tokens, so that every rank
holds real tokens (torch's CP block mask pads a row to a multiple of ``cp_size * 128``: ``_llama3``). Skipped
without torchtitan.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from real_model_cases import comparison_kinds, real_model_case

from cp_harness.judging.render import report_text

# The subjects whose CP path these tests run and judge.
JUDGES = ("spec:llama3_flex", "spec:llama3_flex_ptrr")

REAL_MODELS = True  # tests/conftest.py: skipped without the models extra, one xdist group, one pool
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="needs torchtitan (constraints/torchtitan.txt; scripts/bootstrap.sh installs it)",
)

HEADTAIL = "examples.torchtitan.models.llama3_flex"
PTRR = "examples.torchtitan.models.llama3_flex_ptrr"
STANDIN = {
    "flex_backward_cpu_all_runs": "CPU, stand-in: FlexAttention backward (CP step and one-device runs) = "
    "FlexAttention's eager dense path differentiated (torch's sdpa_dense_backward)"
}
# CP 2, one packed row of 250 tokens (padded to 256): a 100-token document across rank 0's head chunk and rank 1's
# first, a single-token document, and two more across rank 1's and rank 0's tail chunk.
PACKED = {"kind": "packed", "seq_len": 250, "documents": [[100, 1, 90, 59]], "seed": 1}


def test_positions_restart_at_each_document_and_the_padding_is_a_document_of_its_own():
    pytest.importorskip("torchtitan")
    from examples.torchtitan.models import _llama3

    packed = _llama3.make_batch("packed", 9, documents=[[3, 1, 4]], seed=0)
    assert _llama3.positions(packed, 12).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 2, 3]]
    plain = _llama3.make_batch("plain", 5, batch_size=2, seed=0)
    assert _llama3.positions(plain, 8).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]] * 2
    assert [_llama3.cp_padded_length(None, n, c) for n, c in ((250, 2), (256, 2), (9, 3), (9, 1))] == [256, 256, 384, 9]


def test_an_unsupported_dtype_is_refused_naming_the_field_and_why():
    pytest.importorskip("torchtitan")
    from examples.torchtitan.models import _llama3

    with pytest.raises(
        ValueError, match=r"dtype torch.bfloat16 not supported \(supported: \(torch.float32,\); the trainer"
    ):
        _llama3.build(torch.bfloat16)


SMOKE = [
    real_model_case(HEADTAIL, "float32", 2, **PACKED),
    real_model_case(PTRR, "float32", 3, kind="right_padded", seq_len=380, pad=30, batch_size=2, seed=4),
]


@pytest.mark.parametrize("case", SMOKE, ids=["headtail-n2-packed", "ptrr-n3-right_padded"])
def test_smoke_judges_logits_loss_and_every_gradient(real_models, case):
    report = real_models.run(case)
    assert report.ok, report_text(report)
    assert comparison_kinds(report) == {"logits", "loss", "grad"} and not report.not_judged, report_text(report)
    grads = {c.name.split(" (")[0] for c in report.comparisons if c.name.startswith("grad ")}
    assert "grad layers.0.attention.qkv_linear.wqkv.weight" in grads and "grad lm_head.weight" in grads, grads
    assert report.standins == STANDIN
    # torchtitan's FlexAttention CP: K/V all-gathered (forward) and reduce-scattered (backward)
    kernels = {call["kernel"] for rank in report.comm for call in rank["calls"]}
    assert "_c10d_functional::all_gather_into_tensor" in kernels, kernels
    assert "_c10d_functional::reduce_scatter_tensor" in kernels, kernels


def _failing(report) -> dict[str, object]:
    return {c.name.split(" (")[0]: c for c in report.failures()}


def test_a_balancer_chunk_order_swapped_on_rank_1_fails_at_rank_1s_positions(real_models):
    report = real_models.run(real_model_case("torchtitan_spec_balancer_chunks_swapped", "float32", 2, **PACKED))
    failing = _failing(report)
    assert "logits" in failing, report_text(report)
    assert any(name.startswith("grad ") for name in failing), report_text(report)
    # head-tail at CP 2 over 256 positions: rank 1 holds chunks 1 and 2, positions 64-191
    assert 64 <= failing["logits"].worst_index[1] < 192, report_text(report)


def test_an_unshard_in_reversed_rank_order_fails_on_the_logits_only(real_models):
    report = real_models.run(real_model_case("torchtitan_spec_unshard_rank_order", "float32", 2, **PACKED))
    assert set(_failing(report)) == {"logits"}, report_text(report)
    assert comparison_kinds(report) == {"logits", "loss", "grad"}


def test_a_kv_all_gather_in_reversed_rank_order_fails_the_attention(real_models):
    report = real_models.run(real_model_case("torchtitan_spec_kv_gather_rank_order", "float32", 2, **PACKED))
    failing = _failing(report)
    assert "logits" in failing, report_text(report)
    assert "grad layers.0.attention.qkv_linear.wqkv.weight" in failing, report_text(report)


def test_dkv_not_reduce_scattered_fails_on_gradients_only(real_models):
    report = real_models.run(real_model_case("torchtitan_spec_kv_grad_not_reduced", "float32", 2, **PACKED))
    failing = _failing(report)
    assert failing and all(name.startswith("grad ") for name in failing), report_text(report)
    assert "grad layers.0.attention.qkv_linear.wqkv.weight" in failing, report_text(report)
