"""Oracle causal depthwise convolution, against conv1d run on each document's
real span, and hand-checked cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_strategies import packed_lengths

from oracle.convolution import causal_depthwise_conv
from oracle.layout import FILLER, layout_from_attention_mask, layout_from_lengths


def _conv1d_reference(x, weight, seq_lens, seq_lens_padded, sequence):
    """conv1d (groups=C) on each document's real span, zero elsewhere.

    ``seq_lens`` / ``seq_lens_padded`` are lists of rows (filler allowed).
    """
    batch, _, channels = x.shape
    width = weight.shape[0]
    # conv1d is a cross-correlation: kernel tap m reads input t + m - (W - 1)
    # after left padding by W - 1, i.e. tap k = W - 1 - m of the oracle.
    kernel = weight.flip(0).t().reshape(channels, 1, width)
    y = torch.zeros_like(x)
    for b in range(batch):
        start = 0
        for real, padded in zip(seq_lens[b], seq_lens_padded[b]):
            if real == FILLER:
                break
            if real > 0:
                span = x[b, start : start + real].t()[None]  # [1, C, real]
                out = F.conv1d(F.pad(span, (width - 1, 0)), kernel, groups=channels)
                y[b, start : start + real] = out[0].t()
            start += padded
    return y


def _x(batch, sequence, channels, seed=0, dtype=torch.float64):
    return torch.randn(batch, sequence, channels, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7])
def test_matches_conv1d_per_document(width):
    seq_lens = [[3, 0, 4, 1], [6, FILLER, FILLER, FILLER], [FILLER] * 4]
    seq_lens_padded = [[4, 1, 4, 2], [8, FILLER, FILLER, FILLER], [FILLER] * 4]
    layout = layout_from_lengths(torch.tensor(seq_lens), torch.tensor(seq_lens_padded), 12)
    x = _x(3, 12, 5, seed=width)
    weight = _x(1, width, 5, seed=100 + width)[0]
    y = causal_depthwise_conv(x, weight, layout.keep, layout.document_ids)
    expected = _conv1d_reference(x, weight, seq_lens, seq_lens_padded, 12)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_hand_example_width_two():
    # One row: doc 0 = [1, 2] + one padding slot, doc 1 = [10, 20, 30], tail slot.
    layout = layout_from_lengths(torch.tensor([[2, 3]]), torch.tensor([[3, 3]]), 7)
    x = torch.tensor([1.0, 2.0, 99.0, 10.0, 20.0, 30.0, 77.0], dtype=torch.float64)[None, :, None]
    weight = torch.tensor([[1.0], [0.5]], dtype=torch.float64)  # y[t] = x[t] + 0.5 x[t-1]
    y = causal_depthwise_conv(x, weight, layout.keep, layout.document_ids)
    expected = torch.tensor([1.0, 2.5, 0.0, 10.0, 25.0, 40.0, 0.0], dtype=torch.float64)[None, :, None]
    assert torch.equal(y, expected)


def test_left_padded_rows():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    layout = layout_from_attention_mask(mask)
    x = _x(2, 6, 3, seed=1)
    weight = _x(1, 3, 3, seed=2)[0]
    y = causal_depthwise_conv(x, weight, layout.keep, layout.document_ids)
    expected = torch.zeros_like(x)
    for b in range(2):
        idx = mask[b].nonzero().flatten()
        span = x[b, idx].t()[None]
        kernel = weight.flip(0).t().reshape(3, 1, 3)
        expected[b, idx] = F.conv1d(F.pad(span, (2, 0)), kernel, groups=3)[0].t()
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_padding_outputs_and_gradients_are_exactly_zero_even_with_garbage():
    layout = layout_from_lengths(torch.tensor([[3, 0, 2], [FILLER] * 3]), torch.tensor([[4, 2, 3], [FILLER] * 3]), 10)
    x = _x(2, 10, 4, seed=3)
    pad = ~layout.keep
    x[pad] = float("inf")
    x[0, 3] = float("nan")
    x.requires_grad_(True)
    weight = _x(1, 3, 4, seed=4)[0].requires_grad_(True)
    y = causal_depthwise_conv(x, weight, layout.keep, layout.document_ids)
    assert torch.isfinite(y).all()
    assert torch.equal(y[pad], torch.zeros_like(y[pad]))
    y.backward(_x(2, 10, 4, seed=5))
    assert torch.equal(x.grad[pad], torch.zeros_like(x.grad[pad]))
    assert torch.isfinite(weight.grad).all()


def test_gradcheck():
    layout = layout_from_lengths(torch.tensor([[2, 3]]), torch.tensor([[3, 3]]), 7)
    x = _x(1, 7, 2, seed=6).requires_grad_(True)
    weight = _x(1, 3, 2, seed=7)[0].requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x, w: causal_depthwise_conv(x, w, layout.keep, layout.document_ids), (x, weight)
    )


def test_errors():
    keep = torch.ones(1, 3, dtype=torch.bool)
    docs = torch.zeros(1, 3, dtype=torch.int64)
    x = torch.zeros(1, 3, 2)
    with pytest.raises(ValueError, match="width"):
        causal_depthwise_conv(x, torch.zeros(0, 2), keep, docs)
    with pytest.raises(ValueError, match="channels"):
        causal_depthwise_conv(x, torch.zeros(2, 3), keep, docs)
    with pytest.raises(ValueError, match="document_ids must be"):
        causal_depthwise_conv(x, torch.zeros(2, 2), keep, docs[:, :1])


@st.composite
def conv_cases(draw):
    sequence, lens, padded = draw(packed_lengths(10))
    return sequence, lens, padded, draw(st.integers(1, 5)), draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(conv_cases())
def test_property_matches_conv1d(case):
    sequence, lens, padded, width, seed = case
    layout = layout_from_lengths(torch.tensor(lens, dtype=torch.int64).reshape(1, -1),
                                 torch.tensor(padded, dtype=torch.int64).reshape(1, -1), sequence)
    x = _x(1, sequence, 3, seed=seed)
    weight = _x(1, width, 3, seed=seed + 1)[0]
    y = causal_depthwise_conv(x, weight, layout.keep, layout.document_ids)
    expected = _conv1d_reference(x, weight, [lens], [padded], sequence)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
