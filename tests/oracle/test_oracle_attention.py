"""Oracle attention and rotary embedding, against scaled_dot_product_attention,
a per-query loop, and hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_strategies import packed_lengths

from oracle.attention import allowed_keys, attention, rotary_embedding
from oracle.layout import FILLER, layout_from_attention_mask, layout_from_lengths


def _qkv(batch, sequence, q_heads, kv_heads, head_dim, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sequence, q_heads, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, sequence, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, sequence, kv_heads, head_dim, generator=g, dtype=dtype)
    return q, k, v


def _sdpa_reference(q, k, v, keep, document_ids, window=None):
    """Per row, on the kept slots only, with an explicit per-document mask."""
    batch, sequence, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(batch):
        idx = keep[b].nonzero().flatten()
        if idx.numel() == 0:
            continue  # a row that is all padding
        docs = document_ids[b, idx]
        n = idx.numel()
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            for j in range(n):
                same = bool(docs[i] == docs[j])
                causal = int(idx[j]) <= int(idx[i])
                inside = window is None or int(idx[i]) - int(idx[j]) < window
                mask[i, j] = same and causal and inside
        qb = q[b, idx].transpose(0, 1)  # [heads, n, head_dim]
        kb = k[b, idx].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[b, idx].repeat_interleave(group, dim=1).transpose(0, 1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        out[b, idx] = ob.transpose(0, 1)
    return out


def _loop_reference(q, k, v, keep, document_ids, window=None, softcap=None):
    """One query at a time, in plain Python over the allowed keys."""
    batch, sequence, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(batch):
        for i in range(sequence):
            if not keep[b, i]:
                continue
            keys = [
                j
                for j in range(i + 1)
                if keep[b, j]
                and document_ids[b, j] == document_ids[b, i]
                and (window is None or i - j < window)
            ]
            for h in range(q_heads):
                scores = []
                for j in keys:
                    s = float(q[b, i, h] @ k[b, j, h // group]) / math.sqrt(head_dim)
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    scores.append(s)
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                out[b, i, h] = sum(w / total * v[b, j, h // group] for w, j in zip(weights, keys))
    return out


PACKED = dict(seq_lens=[[3, 0, 4, 1], [6, FILLER, FILLER, FILLER], [FILLER] * 4],
              seq_lens_padded=[[4, 1, 4, 2], [8, FILLER, FILLER, FILLER], [FILLER] * 4])


@pytest.mark.parametrize("window", [None, 1, 2, 3])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (3, 1)])
def test_matches_sdpa_on_packed_rows(window, heads):
    layout = layout_from_lengths(torch.tensor(PACKED["seq_lens"]), torch.tensor(PACKED["seq_lens_padded"]), 12)
    q, k, v = _qkv(3, 12, heads[0], heads[1], 4, seed=1)
    out = attention(q, k, v, layout.keep, layout.document_ids, window=window)
    expected = _sdpa_reference(q, k, v, layout.keep, layout.document_ids, window)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~layout.keep], torch.zeros_like(out[~layout.keep]))


def test_matches_sdpa_on_left_and_two_sided_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    layout = layout_from_attention_mask(mask)
    q, k, v = _qkv(3, 6, 4, 2, 4, seed=2)
    out = attention(q, k, v, layout.keep, layout.document_ids)
    expected = _sdpa_reference(q, k, v, layout.keep, layout.document_ids)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [None, 2])
def test_softcap_matches_loop(window):
    layout = layout_from_lengths(torch.tensor([[3, 4]]), torch.tensor([[4, 4]]), 9)
    q, k, v = _qkv(1, 9, 4, 2, 4, seed=3)
    q = q * 3  # make the cap matter
    out = attention(q, k, v, layout.keep, layout.document_ids, window=window, softcap=1.5)
    expected = _loop_reference(q, k, v, layout.keep, layout.document_ids, window, softcap=1.5)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    uncapped = attention(q, k, v, layout.keep, layout.document_ids, window=window)
    assert not torch.allclose(out, uncapped)


def test_one_token_documents_copy_their_value_through_the_gqa_map():
    layout = layout_from_lengths(torch.tensor([[1, 1, 1]]), torch.tensor([[1, 1, 1]]), 3)
    q, k, v = _qkv(1, 3, 4, 2, 4, seed=4)
    out = attention(q, k, v, layout.keep, layout.document_ids)
    for h in range(4):
        assert torch.equal(out[0, :, h], v[0, :, h // 2])


def test_window_one_copies_values_and_hand_two_token_case():
    keep = torch.ones(1, 2, dtype=torch.bool)
    docs = torch.zeros(1, 2, dtype=torch.int64)
    q = torch.tensor([[[[1.0, 0.0]], [[1.0, 0.0]]]], dtype=torch.float64)  # [1, 2, 1, 2]
    k = torch.tensor([[[[0.0, 0.0]], [[2.0, 0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]], dtype=torch.float64)
    assert torch.equal(attention(q, k, v, keep, docs, window=1), v)
    # Query 1: scores [0, 2] / sqrt(2); weights softmax of those.
    out = attention(q, k, v, keep, docs)
    w1 = math.exp(2 / math.sqrt(2)) / (1 + math.exp(2 / math.sqrt(2)))
    expected = torch.tensor([[1.0, 2.0], [(1 - w1) * 1 + w1 * 3, (1 - w1) * 2 + w1 * 4]], dtype=torch.float64)
    torch.testing.assert_close(out[0, :, 0], expected, rtol=1e-14, atol=0)


def test_allowed_keys_hand_example():
    layout = layout_from_lengths(torch.tensor([[2, 2]]), torch.tensor([[3, 2]]), 6)
    # slots: d0 d0 pad(d0) d1 d1 tail
    allowed = allowed_keys(layout.keep, layout.document_ids).to(torch.int64)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],
        ]
    )
    assert torch.equal(allowed[0], expected)


def test_padding_outputs_and_gradients_are_exactly_zero_even_with_garbage():
    layout = layout_from_lengths(torch.tensor([[3, 0, 2], [FILLER] * 3]), torch.tensor([[4, 2, 3], [FILLER] * 3]), 10)
    q, k, v = _qkv(2, 10, 4, 2, 4, seed=5)
    pad = ~layout.keep
    for t in (q, k, v):
        t[pad] = float("inf")
        b, s = pad.nonzero()[0].tolist()
        t[b, s] = float("nan")
        t.requires_grad_(True)
    out = attention(q, k, v, layout.keep, layout.document_ids, window=3, softcap=2.0)
    assert torch.isfinite(out).all()
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    out.backward(upstream)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.equal(t.grad[pad], torch.zeros_like(t.grad[pad]))
        assert t.grad[layout.keep].abs().sum() > 0


@pytest.mark.parametrize("window, softcap", [(None, None), (2, None), (None, 1.0)])
def test_gradcheck(window, softcap):
    layout = layout_from_lengths(torch.tensor([[2, 3]]), torch.tensor([[3, 3]]), 7)
    q, k, v = _qkv(1, 7, 2, 1, 2, seed=7)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, layout.keep, layout.document_ids, window=window, softcap=softcap),
        (q, k, v),
    )


@st.composite
def attention_cases(draw):
    sequence, lens, padded = draw(packed_lengths(9))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.integers(1, 2))
    window = draw(st.one_of(st.none(), st.integers(1, 4)))
    seed = draw(st.integers(0, 2**16))
    return sequence, lens, padded, kv_heads * group, kv_heads, window, seed


@settings(max_examples=25, deadline=None)
@given(attention_cases())
def test_property_matches_sdpa(case):
    sequence, lens, padded, q_heads, kv_heads, window, seed = case
    layout = layout_from_lengths(torch.tensor([lens], dtype=torch.int64).reshape(1, -1),
                                 torch.tensor([padded], dtype=torch.int64).reshape(1, -1), sequence)
    q, k, v = _qkv(1, sequence, q_heads, kv_heads, 2, seed=seed)
    out = attention(q, k, v, layout.keep, layout.document_ids, window=window)
    expected = _sdpa_reference(q, k, v, layout.keep, layout.document_ids, window)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_errors():
    q, k, v = _qkv(1, 3, 3, 2, 2)
    keep = torch.ones(1, 3, dtype=torch.bool)
    docs = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        attention(q, k, v, keep, docs)
    q, k, v = _qkv(1, 3, 2, 1, 2)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, keep, docs, window=0)
    with pytest.raises(ValueError, match="keep must be"):
        attention(q, k, v, keep[:, :2], docs)
    with pytest.raises(ValueError, match="keep must be bool"):
        attention(q, k, v, keep.to(torch.int64), docs)
    with pytest.raises(ValueError, match="k and v"):
        attention(q, k[:, :2], v, keep, docs)


# ------------------------------------------------------------------ rotary


def test_rotary_position_zero_is_identity_and_hand_value():
    x = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    positions = torch.tensor([[0, 1]])
    y = rotary_embedding(x, positions, base=100.0)
    assert torch.equal(y[0, 0], x[0, 0])
    # Dh = 4: inv_freq = [1, 100 ** -0.5] = [1, 0.1]; pairs (x0, x2) and (x1, x3).
    a, b, c, d = x[0, 1, 0].tolist()
    expected = torch.tensor(
        [
            a * math.cos(1.0) - c * math.sin(1.0),
            b * math.cos(0.1) - d * math.sin(0.1),
            c * math.cos(1.0) + a * math.sin(1.0),
            d * math.cos(0.1) + b * math.sin(0.1),
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(y[0, 1, 0], expected, rtol=1e-14, atol=1e-15)


def test_rotary_matches_complex_rotation_and_is_relative():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 3, 6, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 50, (2, 5), generator=g)
    y = rotary_embedding(x, positions)
    half = 3
    inv_freq = 10000.0 ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    z = torch.complex(x[..., :half], x[..., half:])
    rotated = z * torch.polar(torch.ones(2, 5, 1, half, dtype=torch.float64),
                              positions[..., None, None].double() * inv_freq)
    torch.testing.assert_close(y, torch.cat([rotated.real, rotated.imag], -1), rtol=1e-12, atol=1e-12)
    # Scores depend only on the relative offset.
    q = x[:1, :1, :1]
    k = x[:1, 1:2, :1]
    s1 = rotary_embedding(q, torch.tensor([[7]])).flatten() @ rotary_embedding(k, torch.tensor([[3]])).flatten()
    s2 = rotary_embedding(q, torch.tensor([[24]])).flatten() @ rotary_embedding(k, torch.tensor([[20]])).flatten()
    torch.testing.assert_close(s1, s2, rtol=1e-12, atol=1e-12)


def test_rotary_dtype_and_errors():
    x = torch.randn(1, 2, 1, 4, dtype=torch.float32)
    assert rotary_embedding(x, torch.tensor([[0, 3]])).dtype == torch.float32
    with pytest.raises(ValueError, match="even"):
        rotary_embedding(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.zeros(1, 2, 1, 4), torch.zeros(1, 3, dtype=torch.int64))
