"""The stand-in ``glm_dsa_kernels_cpu`` (one process): GLM-5.2 DSA's TileLang entry points computed in torch,
against the model's own torch (non-CP) path in ``glm_moe_dsa/layers.py`` on one device, and against formulas
written out here.

* Indexer: the framework's ``tilelang_indexer_topk`` on the stand-in selects, for every query of one document,
  exactly the causal keys the model's torch indexer (``backend.attn="sdpa"``) selects (sets equal; the TileLang
  width is fixed, ``-1`` padding). Its CP form (``query_indices`` of one contiguous shard) gives those rows.
* Sparse MLA: a shared (``skip_topk``) ``GlmMoeDsaMLA`` fed one selection: the TileLang path on the stand-in
  (THD, bfloat16 latent kernel) and the model's bfloat16 torch path (dense SDPA with the sparse mask, on the same
  tokens as one BSHD row: its SDPA call does not take THD tensors) against the torch path in float64 (the same bfloat16 weights and input): output, input gradient and every parameter
  gradient. Bound per tensor: 4 x the model's own bfloat16 torch path error + 2 bfloat16 ULP of the float64
  tensor's largest magnitude (the kernel's bfloat16 output), the rule of ``test_ring_sdpa_cpu.py``.
* Kernel level, float64 references of the same bfloat16 inputs: the sparse MLA forward (base-2 LSE) and its
  hand-written backward against autograd of a masked softmax; the indexer backward against autograd of the
  score formula. Bound: 2 bfloat16 ULP of the largest magnitude for bfloat16 outputs, 64 float32 ULP otherwise.
* Refusals (the kernels' asserts), the dispatch outside the stand-in (refused on a CPU), install / uninstall.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from cp_harness import standins
from cp_harness.standins import glm_dsa_kernels_cpu as stand



@pytest.fixture(autouse=True)
def _eager():
    """The framework torch.compile's ``Float32RMSNorm``; compiling it was a third of this module's time, for code
    that is neither the stand-in nor the kernel under test. Eager here, as the default command's real-model pools
    run it (``TORCHDYNAMO_DISABLE=1``, tests/conftest.py): the same math."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


BF16_ULP = 2.0**-7
F32_ULP = 2.0**-23
SEQ = 160  # > index_topk: the indexer selects
TOPK = 64


def _config(**overrides):
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    from examples.automodel.models.glm_moe_dsa import TINY

    cfg = GlmMoeDsaConfig(**{**TINY, **overrides})
    cfg.dtype = "bfloat16"
    return cfg


def _backend(attn):
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn=attn, linear="torch", rms_norm="torch_fp32", rope_fusion=False)


def _freqs(seq):
    from nemo_automodel.components.models.deepseek_v3.rope_utils import (
        freqs_cis_from_position_ids,
        precompute_freqs_cis,
    )

    return freqs_cis_from_position_ids(
        torch.arange(seq), precompute_freqs_cis(64, 4096, 10000.0, None), qkv_format="thd"
    )


def _module(cls, attn, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = cls(_config(), _backend(attn), **kwargs)
    if hasattr(module, "indexer"):
        module.init_weights(torch.device("cpu"), init_std=0.2)
    else:
        module.init_weights(init_std=0.2)
    return module.to(torch.bfloat16)


def _twin(module, cls, attn, **kwargs):
    twin = cls(_config(), _backend(attn), **kwargs).to(torch.bfloat16)
    twin.load_state_dict(module.state_dict())
    return twin


def _x(seq=SEQ, seed=1, dtype=torch.bfloat16):
    return torch.randn(seq, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _thd(seq=SEQ):
    return {"qkv_format": "thd", "cu_seqlens": torch.tensor([0, seq], dtype=torch.int32)}


def _selected(topk, seq):
    """Per query, the set of selected causal keys (``-1`` and future keys dropped)."""
    rows = topk.reshape(seq, -1).tolist()
    return [sorted({j for j in row if 0 <= j <= t}) for t, row in enumerate(rows)]


def test_indexer_selects_what_the_model_torch_indexer_selects():
    from nemo_automodel.components.models.glm_moe_dsa.layers import GlmMoeDsaIndexer

    indexer = _module(GlmMoeDsaIndexer, "tilelang")
    reference = _twin(indexer, GlmMoeDsaIndexer, "sdpa")
    x, freqs = _x(), _freqs(SEQ)
    q_resid = torch.randn(SEQ, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad(), standins.get("glm_dsa_kernels_cpu").install():
        ours = indexer(x, q_resid, freqs, **_thd())
    with torch.no_grad():
        theirs = reference(x, q_resid, freqs, qkv_format="thd")
    assert ours.shape == (SEQ, 1, TOPK) and ours.dtype == torch.int32
    assert _selected(ours, SEQ) == _selected(theirs, SEQ)
    # sparsity is exercised: late queries keep TOPK of their > TOPK causal keys
    assert all(len(keys) == min(t + 1, TOPK) for t, keys in enumerate(_selected(ours, SEQ)))


def test_indexer_cp_rows_by_query_indices():
    """``tilelang_indexer_topk`` with one contiguous shard's ``query_indices`` (global keys, the CP form) gives
    exactly that shard's rows of the one-device call, for compact and padded (``cu_seqlens_padded``) layouts."""
    optimized = importlib.import_module(stand.OPTIMIZED)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(SEQ, 4, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(SEQ, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(SEQ, 4, generator=g)
    cu_real = torch.tensor([0, 70, 150], dtype=torch.int32)
    cu_padded = torch.tensor([0, 72, 160], dtype=torch.int32)
    with standins.get("glm_dsa_kernels_cpu").install():
        for cu, padded in ((torch.tensor([0, 70, 160], dtype=torch.int32), None), (cu_real, cu_padded)):
            full = optimized.tilelang_indexer_topk(q, k, w, cu, TOPK, cu_seqlens_padded=padded)
            for shard in range(4):
                rows = torch.arange(shard * 40, (shard + 1) * 40)
                part = optimized.tilelang_indexer_topk(
                    q[rows], k, w[rows], cu, TOPK, query_indices=rows.int(), cu_seqlens_padded=padded
                )
                assert torch.equal(part, full[rows])
        # documents do not see each other; CP padding keys are never chosen for a real query
        chosen = optimized.tilelang_indexer_topk(q, k, w, cu_real, TOPK, cu_seqlens_padded=cu_padded)[:, 0]
        assert int(chosen[100].max()) <= 100 and int(chosen[100][chosen[100] >= 0].min()) >= 72
        assert not ((chosen[:70] >= 70) & (chosen[:70] < 72)).any()


def _error(tensor, reference):
    return float((tensor.double() - reference).abs().max())


def test_sparse_mla_matches_the_model_torch_path_forward_and_gradients():
    from nemo_automodel.components.models.glm_moe_dsa.layers import GlmMoeDsaMLA

    mla = _module(GlmMoeDsaMLA, "tilelang", skip_topk=True)
    torch_bf16 = _twin(mla, GlmMoeDsaMLA, "sdpa", skip_topk=True)
    torch_f64 = _twin(mla, GlmMoeDsaMLA, "sdpa", skip_topk=True).double()
    g = torch.Generator().manual_seed(4)
    # as the indexer selects: distinct causal keys, the query itself always among them, -1 after the valid ones
    causal = torch.full((SEQ, TOPK), -1, dtype=torch.long)
    for t in range(SEQ):
        keys = torch.cat([torch.tensor([t]), torch.randperm(t, generator=g)[: TOPK - 1]])
        causal[t, : keys.numel()] = keys
    topk = causal.to(torch.int32).unsqueeze(1).contiguous()
    dense = torch.where(causal >= 0, causal, torch.arange(SEQ).unsqueeze(1))  # the torch path has no -1
    x, freqs = _x(), _freqs(SEQ)
    grad_out = torch.randn(SEQ, 64, generator=g)

    def run(module, x, indices, dtype, rows=False, **kwargs):
        """``module`` on ``x`` [T, hidden] (THD) or, ``rows``, on the one BSHD row ``[1, T, hidden]`` (the torch
        path's dense SDPA takes BSHD); output and input gradient back as ``[T, hidden]``."""
        x = x.detach().to(dtype).clone().requires_grad_()
        lift = (lambda t: t.unsqueeze(0)) if rows else (lambda t: t)
        out = module(lift(x), lift(freqs), prev_topk_indices=lift(indices), **kwargs)
        out.backward(lift(grad_out.to(dtype)))
        grads = {name: p.grad for name, p in module.named_parameters()}
        return out.detach().reshape(x.shape), x.grad, grads

    with standins.get("glm_dsa_kernels_cpu").install():
        ours = run(mla, x, topk, torch.bfloat16, **_thd())
    bf16 = run(torch_bf16, x, dense, torch.bfloat16, rows=True)
    ref = run(torch_f64, x, dense, torch.float64, rows=True)
    pairs = [("output", ours[0], bf16[0], ref[0]), ("grad x", ours[1], bf16[1], ref[1])]
    pairs += [(f"grad {name}", ours[2][name], bf16[2][name], ref[2][name]) for name in ref[2]]
    assert len(pairs) == 2 + 7  # q_a, q_a norm, q_b, kv_a, kv_a norm, kv_b, o_proj
    for name, tensor, theirs, reference in pairs:
        assert tensor is not None and reference is not None and float(reference.abs().max()) > 0, (name, tensor is None)
        bound = 4 * _error(theirs, reference) + 2 * BF16_ULP * float(reference.abs().max())
        assert _error(tensor, reference) <= bound, (name, _error(tensor, reference), bound)


def _sparse_inputs(seq=40, heads=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, heads, stand.QK_DIM, generator=g).to(torch.bfloat16)
    kv = torch.randn(seq, 1, stand.QK_DIM, generator=g).to(torch.bfloat16)
    idx = torch.full((seq, 1, TOPK), -1, dtype=torch.int32)
    for t in range(seq):
        keys = torch.randperm(t + 1, generator=g)[: min(t + 1, 20)]
        idx[t, 0, : keys.numel()] = keys.int()
    return q, kv, idx, 0.1


def _dense_attention(q, kv, idx, scale):
    """Float64 masked softmax over the selected keys, value = the first 512 channels of kv."""
    mask = torch.zeros(q.shape[0], kv.shape[0], dtype=torch.bool)
    for t in range(q.shape[0]):
        mask[t, idx[t, 0][idx[t, 0] >= 0].long()] = True
    scores = torch.einsum("thc,jc->thj", q, kv[:, 0]) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("thj,jd->thd", torch.softmax(scores, -1), kv[:, 0, : stand.LATENT_DIM]), lse


def test_sparse_mla_kernel_forward_lse_and_backward():
    q, kv, idx, scale = _sparse_inputs()
    with standins.get("glm_dsa_kernels_cpu").install():
        out, lse = importlib.import_module(stand.SPARSE_MLA).sparse_mla_fwd_interface(q, kv, idx, sm_scale=scale)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
        dq, dkv = importlib.import_module(stand.SPARSE_MLA).sparse_mla_bwd(q, kv, out, grad_out, idx, lse, scale)
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    ref_out, ref_lse = _dense_attention(q64, kv64, idx, scale)
    ref_out.backward(grad_out.double())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (40, 3, 512)
    assert _error(out, ref_out) <= 2 * BF16_ULP * float(ref_out.abs().max())
    assert _error(lse, ref_lse / torch.log(torch.tensor(2.0, dtype=torch.float64))) <= 64 * F32_ULP * float(
        ref_lse.abs().max()
    )
    # the kernel's backward recomputes P from the saved bfloat16 output; the float64 reference has the exact one
    assert dq.dtype == q.dtype and dkv.shape == kv.shape
    assert _error(dq, q64.grad) <= 2 * BF16_ULP * float(q64.grad.abs().max())
    assert _error(dkv, kv64.grad) <= 2 * BF16_ULP * float(kv64.grad.abs().max())


def test_indexer_kernel_backward_is_the_score_gradient():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(30, 4, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(30, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(30, 4, generator=g)
    idx = torch.full((30, TOPK), -1, dtype=torch.int32)
    for t in range(30):
        idx[t, : t + 1] = torch.arange(t + 1, dtype=torch.int32)
    grad_scores = torch.randn(30, TOPK, generator=g)
    with standins.get("glm_dsa_kernels_cpu").install():
        grad_q, grad_w, grad_k = importlib.import_module(stand.INDEXER).indexer_bwd_interface(q, w, k, idx, grad_scores)
    q64, k64, w64 = (t.double().requires_grad_() for t in (q, k, w))
    valid = idx >= 0
    keys = k64[idx.clamp(min=0).long()]
    scores = (torch.einsum("thd,tkd->thk", q64, keys).relu() * w64.unsqueeze(-1)).sum(1)
    (scores * valid * grad_scores.double()).sum().backward()
    assert grad_q.dtype == torch.bfloat16 and grad_w.dtype == torch.float32 and grad_k.dtype == torch.float32
    assert _error(grad_q, q64.grad) <= 2 * BF16_ULP * float(q64.grad.abs().max())
    assert _error(grad_w, w64.grad) <= 64 * F32_ULP * float(w64.grad.abs().max())
    assert _error(grad_k, k64.grad) <= 64 * F32_ULP * float(k64.grad.abs().max())


def test_indexer_kernel_forward_windows():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(6, 2, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(6, 2, generator=g)
    ks = torch.tensor([0, 0, 0, 3, 3, 3], dtype=torch.int32)
    ke = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)
    with standins.get("glm_dsa_kernels_cpu").install():
        logits = importlib.import_module(stand.INDEXER).indexer_fwd_interface(q, k, w, ks, ke)
    expected = (torch.einsum("thd,jd->thj", q.double(), k.double()).relu() * w.double().unsqueeze(-1)).sum(1)
    for t in range(6):
        inside = torch.arange(6)
        inside = (inside >= ks[t]) & (inside < ke[t])
        assert torch.isinf(logits[t][~inside]).all() and (logits[t][~inside] < 0).all()
        assert _error(logits[t][inside], expected[t][inside]) <= 64 * F32_ULP * float(expected.abs().max())


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda q, kv, idx: (q[..., :512].contiguous(), kv[..., :512].contiguous(), idx), "dim_plus_tail_dim"),
        (lambda q, kv, idx: (q, kv, idx[..., :32].contiguous()), "topk must be a multiple of 64"),
        (lambda q, kv, idx: (q.float(), kv, idx), "q must be torch.bfloat16"),
        (lambda q, kv, idx: (q, kv, idx.long()), "indices must be torch.int32"),
    ],
)
def test_sparse_mla_refuses_what_the_kernel_asserts(change, field):
    q, kv, idx = change(*_sparse_inputs()[:3])
    with standins.get("glm_dsa_kernels_cpu").install():
        with pytest.raises(stand.KernelContractError, match=field):
            importlib.import_module(stand.SPARSE_MLA).sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.1)


def test_off_outside_on_inside_once_only():
    optimized = importlib.import_module(stand.OPTIMIZED)
    indexer = importlib.import_module(stand.INDEXER)
    before = (optimized.HAS_TILELANG, optimized._all_cuda, indexer.indexer_fwd_interface)
    q = torch.zeros(2, 2, dtype=torch.bfloat16)
    if not before[0]:  # this CPU install has no tilelang: the framework's dispatch refuses
        with pytest.raises(RuntimeError, match="TileLang backend was requested"):
            optimized.should_use_tilelang("tilelang", available=False, kernel_name="indexer", tensors=(q,))
    with pytest.raises(LookupError, match="leaving"):
        with standins.get("glm_dsa_kernels_cpu").install():
            assert stand.installed() and optimized.HAS_TILELANG
            assert optimized.should_use_tilelang(
                "tilelang", available=optimized.is_dsa_kernel_available("indexer"), kernel_name="indexer",
                tensors=(q,), require_bf16=True,
            )  # fmt: skip
            with pytest.raises(RuntimeError, match="already installed"):
                with standins.get("glm_dsa_kernels_cpu").install():
                    pass
            raise LookupError("leaving by an exception restores too")
    assert not stand.installed()
    assert (optimized.HAS_TILELANG, optimized._all_cuda, indexer.indexer_fwd_interface) == before
    with standins.entered(("glm_dsa_kernels_cpu",), "cuda") as record:
        assert record.descriptions == {} and not stand.installed()
