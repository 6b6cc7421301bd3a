"""The FlexAttention backward stand-in (``cp_harness.standins.flex_backward_cpu``) against the reference semantics.

On one device, float64: uncompiled FlexAttention with a block mask (causal per document, the shape both framework
users build: Gemma4's ring chunks of local queries against global keys, Kimi's MLA over the gathered latent) against
dense masked softmax attention written out here (scores, ``-inf`` where masked, softmax, matmul; natural-log LSE):
outputs, LSE and dQ/dK/dV, with a loss that reaches the LSE as well (the Gemma4 ring merges chunks by LSE, so its
backward sends a gradient into it). Fully masked query rows (a query block whose keys are all in other documents or
in the future: what a ring chunk of earlier keys gives the first rows of a later document) follow FlexAttention's
contract: output 0, LSE ``-inf``, no gradient; the dense reference gives NaN there, so those rows are compared
against that contract and excluded from the softmax reference. GQA (``enable_gqa``) and queries shorter than keys
(a local chunk against global keys) are covered. Outside ``install()`` torch refuses CPU backward as before.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from cp_harness import standins
from cp_harness.standins import flex_backward_cpu

REFUSAL = "FlexAttention does not support backward on CPU"


def _doc_causal(doc_q: torch.Tensor, doc_k: torch.Tensor, q_offset: int):
    """Causal within a document; the queries are global positions ``q_offset + i`` (a chunk of a longer row)."""

    def mask_mod(b, h, q, k):
        return (doc_q[b, q] == doc_k[b, k]) & (q + q_offset >= k)

    return mask_mod


def _dense(q, k, v, allowed, scale):
    """Masked softmax attention written out: float64, ``allowed`` ``[B, 1, Sq, Sk]``; rows with no key -> NaN."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _case(seed: int, sq: int, sk: int, q_offset: int, heads: int, kv_heads: int, docs: list[list[int]]):
    g = torch.Generator().manual_seed(seed)
    b, d = len(docs), 8
    q = torch.randn(b, heads, sq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, sk, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, sk, d, generator=g, dtype=torch.float64, requires_grad=True)
    doc_k = torch.tensor(docs)
    doc_q = doc_k[:, q_offset : q_offset + sq]
    mask_mod = _doc_causal(doc_q, doc_k, q_offset)
    block_mask = create_block_mask(mask_mod, b, None, sq, sk, device="cpu", BLOCK_SIZE=4)
    pos_q = torch.arange(sq)[None, :, None] + q_offset
    pos_k = torch.arange(sk)[None, None, :]
    allowed = ((doc_q[:, :, None] == doc_k[:, None, :]) & (pos_q >= pos_k))[:, None]
    gout = torch.randn(b, heads, sq, d, generator=g, dtype=torch.float64)
    glse = torch.randn(b, heads, sq, generator=g, dtype=torch.float64)
    return q, k, v, block_mask, allowed, gout, glse


CASES = [
    # seed, q length, k length, query offset, heads, kv heads, documents per row
    (0, 12, 12, 0, 2, 2, [[0] * 5 + [1] * 7]),
    (1, 8, 16, 8, 2, 2, [[0] * 6 + [1] * 10, [2] * 16]),  # a chunk of local queries against global keys
    (2, 12, 12, 0, 4, 2, [[0] * 3 + [1] * 4 + [2] * 5]),  # GQA
    (3, 4, 8, 0, 2, 1, [[0] * 4 + [1] * 4]),  # keys beyond the queries: a later ring chunk
]


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_flex_backward_on_cpu_is_dense_masked_attention(case):
    seed, sq, sk, q_offset, heads, kv_heads, docs = case
    q, k, v, block_mask, allowed, gout, glse = _case(seed, sq, sk, q_offset, heads, kv_heads, docs)
    scale = q.shape[-1] ** -0.5
    with standins.entered(("flex_backward_cpu",), "cpu") as record:
        out, aux = flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=heads != kv_heads, return_aux=AuxRequest(lse=True)
        )
        lse = aux.lse
        live = torch.isfinite(lse)
        loss = (out * gout).sum() + (torch.where(live, lse, 0.0) * glse).sum()
        got = torch.autograd.grad(loss, (q, k, v))
        assert record.used() == {"flex_backward_cpu": flex_backward_cpu.FLEX_BACKWARD_CPU.description}
    ref_out, ref_lse = _dense(q, k, v, allowed, scale)
    live_ref = allowed.any(-1).expand_as(ref_lse)
    assert torch.equal(live, live_ref)
    ref_loss = (torch.where(live_ref[..., None], ref_out, 0.0) * gout).sum() + (
        torch.where(live_ref, ref_lse, 0.0) * glse
    ).sum()
    want = torch.autograd.grad(ref_loss, (q, k, v))
    tol = 1e-12
    torch.testing.assert_close(out[live_ref], ref_out[live_ref], rtol=0, atol=tol)
    torch.testing.assert_close(lse[live_ref], ref_lse[live_ref], rtol=0, atol=tol)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=f"d{name}")


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_no_gradient():
    """Document 1's first queries against a chunk of keys all in document 0: no key allowed."""
    g = torch.Generator().manual_seed(4)
    q, k, v, gout = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64, requires_grad=i < 3) for i in range(4))
    k_chunk, v_chunk = k, v
    doc = torch.tensor([[0] * 4 + [1] * 4])

    def mask_mod(b, h, qi, ki):
        return doc[b, qi + 4] == doc[b, ki]

    block_mask = create_block_mask(mask_mod, 1, None, 4, 4, device="cpu", BLOCK_SIZE=4)
    with standins.entered(("flex_backward_cpu",), "cpu"):
        out, aux = flex_attention(q, k_chunk, v_chunk, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        dq, dk, dv = torch.autograd.grad((out * gout).sum(), (q, k, v))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(aux.lse).all()
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


def test_off_outside_its_context_and_restored_after_an_exception():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match=REFUSAL):
        flex_attention(q, q, q)
    assert not flex_backward_cpu.installed()
    with pytest.raises(ZeroDivisionError):
        with standins.entered(("flex_backward_cpu",), "cpu"):
            assert flex_backward_cpu.installed()
            flex_attention(q, q, q).sum().backward()
            assert q.grad is not None
            raise ZeroDivisionError("the block fails")
    assert not flex_backward_cpu.installed()
    with pytest.raises(NotImplementedError, match=REFUSAL):
        flex_attention(q, q, q)
    with torch.no_grad():
        x = q.detach()
        flex_attention(x, x, x)  # forward without grad: torch's own path, the stand-in not needed


def test_not_entered_on_another_device_and_refuses_to_enter_twice():
    with standins.entered(("flex_backward_cpu",), "cuda") as record:
        assert not flex_backward_cpu.installed() and record.descriptions == {}
    with flex_backward_cpu.install():
        with pytest.raises(RuntimeError, match="already installed"):
            with flex_backward_cpu.install():
                pass
        assert flex_backward_cpu.installed()
    assert not flex_backward_cpu.installed()


def test_other_device_checks_stay_torchs():
    """The stand-in hides only requires_grad from torch's check: an unsupported device still raises torch's error."""
    meta = torch.empty(1, 1, 4, 8, device="meta", requires_grad=True)
    with flex_backward_cpu.install():
        with pytest.raises(ValueError, match="only supported on CUDA, CPU"):
            torch.nn.attention.flex_attention._validate_device(meta, meta, meta)
