"""``flash_attn_cpu`` on one device, float64, against plain attention written out here and differentiated by autograd:
the output, the LSE (flash-attn's convention: natural log, ``[B, H, Sq]`` dense, ``[H, total_q]`` varlen), and the
backward's contract (gradients of the joint softmax when handed a merged out / LSE, written into the given buffers,
views included); causal bottom-right aligned; refusals; installed only inside its context."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cp_harness import standins
from cp_harness.standins import flash_attn_cpu as fa

TOL = dict(rtol=0, atol=1e-12)


@pytest.fixture(autouse=True)
def _float64_inputs():
    """float64 inputs for the contract tests (the kernel itself takes fp16/bf16 only: the last tests)."""
    with fa.wide_dtypes():
        yield


def _qkv(b, sq, sk, h=2, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=dtype) for s in (sq, sk, sk)]


def _plain(q, k, v, scale, allowed):
    """Softmax attention ``[B, S, H, D]`` with an ``allowed [Sq, Sk]`` mask, and its LSE ``[B, H, Sq]``."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), lse


def _causal(sq, sk):
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)


@pytest.mark.parametrize("causal,sq,sk", [(True, 5, 5), (False, 3, 6), (True, 3, 6)])
def test_dense_forward_and_lse_match_plain_attention(causal, sq, sk):
    q, k, v = _qkv(2, sq, sk)
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, 0.3, causal, -1, -1, 0.0, None, False)
    allowed = _causal(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    ref, ref_lse = _plain(q, k, v, 0.3, allowed)
    assert out.shape == q.shape and lse.shape == (2, 2, sq)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_backward_is_autograd_of_plain_attention(causal):
    q, k, v = _qkv(1, 6, 6, seed=1)
    allowed = _causal(6, 6) if causal else torch.ones(6, 6, dtype=torch.bool)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref, _ = _plain(*leaves, 0.5, allowed)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, 0.5, causal, -1, -1, 0.0, None, False)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.5, causal, -1, -1, 0.0, None, False, None)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, **TOL)


def test_backward_against_a_merged_out_and_lse_gives_the_joint_softmax_gradients():
    """What the rings rely on: two key blocks run separately, merged by LSE, and each block's backward handed the
    merged out / LSE; the gradients sum to those of attention over both blocks at once."""
    q, k, v = _qkv(1, 4, 8, seed=2)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref, _ = _plain(*leaves, 0.4, torch.ones(4, 8, dtype=torch.bool))
    dout = torch.randn_like(ref)
    ref.backward(dout)
    parts = [fa._flash_attn_forward(q, k[:, a:b], v[:, a:b], 0.0, 0.4, False, -1, -1, 0.0, None, False) for a, b in
             ((0, 3), (3, 8))]  # fmt: skip
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(l_ - lse).transpose(1, 2)[..., None] for o, l_, _, _ in parts)
    torch.testing.assert_close(out, ref.detach(), **TOL)
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for a, b in ((0, 3), (3, 8)):
        step_dq = torch.empty_like(q)
        fa._flash_attn_backward(
            dout, q, k[:, a:b], v[:, a:b], out, lse, step_dq, dk[:, a:b], dv[:, a:b], 0.0, 0.4, False, -1, -1, 0.0,
            None, False, None,
        )  # fmt: skip
        dq += step_dq
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, **TOL)


def test_varlen_keeps_documents_apart_and_writes_into_views():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q, k, v = (t[0] for t in _qkv(1, 9, 9, seed=3))
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.0, 0.7, True, -1, -1, 0.0, None, False)
    assert lse.shape == (2, 9)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    pieces, lses = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o, l_ = _plain(*(x[None, a:b] for x in leaves), 0.7, _causal(b - a, b - a))
        pieces.append(o[0])
        lses.append(l_[0])
    ref = torch.cat(pieces)
    torch.testing.assert_close(out, ref.detach(), **TOL)
    torch.testing.assert_close(lse, torch.cat(lses, -1).detach(), **TOL)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    bufs = [torch.full((12, 2, 4), float("nan"), dtype=torch.float64) for _ in range(3)]
    fa._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, bufs[0][:9], bufs[1][:9], bufs[2][:9], cu, cu, 5, 5, 0.0, 0.7, True, -1, -1, 0.0,
        None, False, None, False,
    )  # fmt: skip
    for buf, leaf in zip(bufs, leaves):
        torch.testing.assert_close(buf[:9], leaf.grad, **TOL)
        assert torch.isnan(buf[9:]).all()  # nothing written past the view


def test_bfloat16_computes_in_float32_and_rounds_once():
    q, k, v = _qkv(1, 5, 5, seed=4)
    out, lse, _, _ = fa._flash_attn_forward(*(t.bfloat16() for t in (q, k, v)), 0.0, 0.5, True, -1, -1, 0.0, None,
                                            False)  # fmt: skip
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, ref_lse = _plain(*(t.bfloat16().double() for t in (q, k, v)), 0.5, _causal(5, 5))
    torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)  # float32 math, one rounding
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_a_query_row_with_no_key_gets_zero_output_and_infinite_lse():
    q, k, v = _qkv(1, 4, 2, seed=5)  # causal, bottom-right: the first two queries see no key
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, 1.0, True, -1, -1, 0.0, None, False)
    assert (out[:, :2] == 0).all() and torch.isposinf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()


@pytest.mark.parametrize(
    "args,word",
    [
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(window_left=3), "window_size_left"),
        (dict(softcap=2.0), "softcap"),
        (dict(alibi=torch.ones(2)), "alibi_slopes"),
        (dict(ret=True), "return_softmax"),
    ],
)
def test_unsupported_arguments_are_refused_by_name(args, word):
    q, k, v = _qkv(1, 3, 3)
    full = dict(dropout_p=0.0, window_left=-1, window_right=-1, softcap=0.0, alibi=None, ret=False) | args
    with pytest.raises(NotImplementedError, match=word):
        fa._flash_attn_forward(q, k, v, full["dropout_p"], 1.0, True, full["window_left"], full["window_right"],
                               full["softcap"], full["alibi"], full["ret"])  # fmt: skip


def test_other_dtypes_are_refused_as_the_kernel_refuses_them():
    q, k, v = _qkv(1, 3, 3, dtype=torch.float32)
    fa._flash_attn_forward(q, k, v, 0.0, 1.0, True, -1, -1, 0.0, None, False)  # inside wide_dtypes: computed
    fa._wide = False  # what the gate sees (the fixture restores it)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        fa._flash_attn_forward(q, k, v, 0.0, 1.0, True, -1, -1, 0.0, None, False)
    fa._flash_attn_forward(*(t.half() for t in (q, k, v)), 0.0, 1.0, True, -1, -1, 0.0, None, False)


def test_fewer_kv_heads_are_refused():
    q, k, v = _qkv(1, 3, 3, h=2)
    with pytest.raises(NotImplementedError, match="GQA"):
        fa._flash_attn_forward(q, k[:, :, :1], v[:, :, :1], 0.0, 1.0, True, -1, -1, 0.0, None, False)


@pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None, reason="needs nemo-automodel")
def test_bound_only_inside_its_context_and_once():
    ring_attention, zigzag_ring_attention, ulysses_attention = fa.framework_modules()

    before = (ring_attention._flash_attn, zigzag_ring_attention._fa, ulysses_attention._fa)
    standin = standins.get("flash_attn_cpu")
    with pytest.raises(RuntimeError, match="boom"), standin.install():
        assert ring_attention._flash_attn is fa.CPU_INTERFACE and ulysses_attention._fa is fa.CPU_INTERFACE
        assert zigzag_ring_attention.HAVE_FLASH_ATTN
        with pytest.raises(RuntimeError, match="already installed"), standin.install():
            pass
        raise RuntimeError("boom")
    assert (ring_attention._flash_attn, zigzag_ring_attention._fa, ulysses_attention._fa) == before
    with standins.entered(("flash_attn_cpu",), "cuda") as record:
        assert record.descriptions == {} and ring_attention._flash_attn is before[0]
    calls = standin.calls()
    with standins.entered(("flash_attn_cpu",), "cpu", reference=True) as record:
        q, k, v = _qkv(1, 2, 2)
        ring_attention._fa_forward(q, k, v, 1.0, True)
        assert record.used() == {"flash_attn_cpu": standin.description} and standin.calls() == calls + 1
