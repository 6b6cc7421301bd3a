"""Oracle losses, against torch.nn.functional.cross_entropy on labels shifted
per document, and hand-checked edge cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_strategies import packed_lengths

from oracle.layout import FILLER, IGNORE_INDEX, layout_from_attention_mask, layout_from_lengths
from oracle.loss import aligned_cross_entropy, mean_loss, shifted_cross_entropy


def _logits(batch, sequence, vocab, seed=0, dtype=torch.float64):
    return torch.randn(batch, sequence, vocab, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _labels(batch, sequence, vocab, seed=0, ignore_fraction=0.2):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, sequence), generator=g)
    ignored = torch.rand(batch, sequence, generator=g) < ignore_fraction
    return labels.masked_fill(ignored, IGNORE_INDEX)


def _shift_per_document(labels, keep, document_ids):
    """Targets for positions t: labels[t+1] where t, t+1 are kept and in one document, else -100."""
    batch, sequence = labels.shape
    targets = torch.full_like(labels, IGNORE_INDEX)
    for b in range(batch):
        for t in range(sequence - 1):
            if keep[b, t] and keep[b, t + 1] and document_ids[b, t] == document_ids[b, t + 1]:
                targets[b, t] = labels[b, t + 1]
    return targets


def _reference(logits, targets):
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, int((flat_targets != IGNORE_INDEX).sum())


LENS = [[3, 0, 4, 1], [6, FILLER, FILLER, FILLER], [FILLER] * 4]
PADDED = [[4, 1, 4, 2], [8, FILLER, FILLER, FILLER], [FILLER] * 4]


def test_shifted_matches_cross_entropy_per_document():
    layout = layout_from_lengths(torch.tensor(LENS), torch.tensor(PADDED), 12)
    logits = _logits(3, 12, 7, seed=1)
    labels = _labels(3, 12, 7, seed=1)
    loss_sum, count = shifted_cross_entropy(logits, labels, layout.keep, layout.document_ids)
    expected, expected_count = _reference(logits, _shift_per_document(labels, layout.keep, layout.document_ids))
    torch.testing.assert_close(loss_sum, expected, rtol=1e-13, atol=0)
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == expected_count


def test_shifted_without_document_ids_crosses_adjacent_documents():
    # Two adjacent documents without per-document padding: only document_ids separates them.
    layout = layout_from_lengths(torch.tensor([[2, 3]]), torch.tensor([[2, 3]]), 5)
    logits = _logits(1, 5, 4, seed=2)
    labels = torch.tensor([[1, 2, 3, 0, 1]])
    _, with_docs = shifted_cross_entropy(logits, labels, layout.keep, layout.document_ids)
    _, without_docs = shifted_cross_entropy(logits, labels, layout.keep)
    assert int(with_docs) == 3  # t = 0, 2, 3
    assert int(without_docs) == 4  # t = 1 also predicts the next document's first token


def test_shifted_hand_example():
    logits = torch.zeros(1, 3, 2, dtype=torch.float64)
    logits[0, 0] = torch.tensor([0.0, math.log(3.0)])  # p(1) = 3/4
    logits[0, 1] = torch.tensor([math.log(4.0), 0.0])  # p(0) = 4/5
    labels = torch.tensor([[IGNORE_INDEX, 1, 0]])
    keep = torch.ones(1, 3, dtype=torch.bool)
    loss_sum, count = shifted_cross_entropy(logits, labels, keep)
    assert int(count) == 2
    torch.testing.assert_close(loss_sum, torch.tensor(-math.log(0.75) - math.log(0.8), dtype=torch.float64))


def test_shifted_left_padded_rows():
    layout = layout_from_attention_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]))
    logits = _logits(2, 5, 6, seed=3)
    labels = _labels(2, 5, 6, seed=3, ignore_fraction=0.0)
    loss_sum, count = shifted_cross_entropy(logits, labels, layout.keep, layout.document_ids)
    expected, expected_count = _reference(logits, _shift_per_document(labels, layout.keep, layout.document_ids))
    torch.testing.assert_close(loss_sum, expected, rtol=1e-13, atol=0)
    assert int(count) == expected_count == 5


def test_aligned_matches_cross_entropy():
    layout = layout_from_lengths(torch.tensor(LENS), torch.tensor(PADDED), 12)
    logits = _logits(3, 12, 7, seed=4)
    labels = _labels(3, 12, 7, seed=4)
    loss_sum, count = aligned_cross_entropy(logits, labels, layout.keep)
    expected, expected_count = _reference(logits, labels.masked_fill(~layout.keep, IGNORE_INDEX))
    torch.testing.assert_close(loss_sum, expected, rtol=1e-13, atol=0)
    assert int(count) == expected_count


@pytest.mark.parametrize("shifted", [True, False])
def test_softcap(shifted):
    keep = torch.ones(2, 6, dtype=torch.bool)
    logits = _logits(2, 6, 5, seed=5) * 4
    labels = _labels(2, 6, 5, seed=5)
    capped = 2.0 * torch.tanh(logits / 2.0)
    if shifted:
        got = shifted_cross_entropy(logits, labels, keep, softcap=2.0)
        want = shifted_cross_entropy(capped, labels, keep)
    else:
        got = aligned_cross_entropy(logits, labels, keep, softcap=2.0)
        want = aligned_cross_entropy(capped, labels, keep)
        torch.testing.assert_close(got[0], _reference(capped, labels)[0], rtol=1e-13, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-13, atol=0)
    assert int(got[1]) == int(want[1])


@pytest.mark.parametrize(
    "dtype, result", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                      (torch.float32, torch.float32), (torch.float64, torch.float64)]
)
def test_upcast(dtype, result):
    keep = torch.ones(1, 5, dtype=torch.bool)
    logits = _logits(1, 5, 4, seed=6).to(dtype)
    labels = _labels(1, 5, 4, seed=6, ignore_fraction=0.0)
    loss_sum, _ = shifted_cross_entropy(logits, labels, keep)
    assert loss_sum.dtype == result
    expected, _ = shifted_cross_entropy(logits.to(result), labels, keep)
    assert torch.equal(loss_sum, expected)


@pytest.mark.parametrize("shifted", [True, False])
def test_nothing_counts_gives_exact_differentiable_zero(shifted):
    logits = _logits(2, 4, 3, seed=7).requires_grad_(True)
    labels = torch.full((2, 4), IGNORE_INDEX)
    keep = torch.ones(2, 4, dtype=torch.bool)
    fn = shifted_cross_entropy if shifted else aligned_cross_entropy
    loss_sum, count = fn(logits, labels, keep)
    assert int(count) == 0 and loss_sum.item() == 0.0 and loss_sum.requires_grad
    loss = mean_loss(loss_sum, count)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_short_rows():
    for sequence in (0, 1):
        logits = _logits(1, sequence, 3).requires_grad_(True)
        labels = torch.zeros(1, sequence, dtype=torch.int64)
        keep = torch.ones(1, sequence, dtype=torch.bool)
        loss_sum, count = shifted_cross_entropy(logits, labels, keep)
        assert int(count) == 0 and loss_sum.item() == 0.0


def test_uncounted_rows_get_exactly_zero_gradient_even_with_garbage():
    layout = layout_from_lengths(torch.tensor(LENS), torch.tensor(PADDED), 12)
    logits = _logits(3, 12, 7, seed=8)
    labels = _labels(3, 12, 7, seed=8)
    logits[~layout.keep] = float("nan")
    logits[2, 5] = float("inf")
    logits.requires_grad_(True)
    loss_sum, count = shifted_cross_entropy(logits, labels, layout.keep, layout.document_ids)
    assert torch.isfinite(loss_sum)
    mean_loss(loss_sum, count).backward()
    counted = torch.zeros(3, 12, dtype=torch.bool)
    counted[:, :-1] = _shift_per_document(labels, layout.keep, layout.document_ids)[:, :-1] != IGNORE_INDEX
    assert torch.equal(logits.grad[~counted], torch.zeros_like(logits.grad[~counted]))
    assert torch.isfinite(logits.grad).all()


def test_gradcheck():
    layout = layout_from_lengths(torch.tensor([[2, 3]]), torch.tensor([[3, 3]]), 7)
    logits = _logits(1, 7, 3, seed=9).requires_grad_(True)
    labels = _labels(1, 7, 3, seed=9, ignore_fraction=0.0)
    assert torch.autograd.gradcheck(
        lambda z: shifted_cross_entropy(z, labels, layout.keep, layout.document_ids, softcap=1.5)[0], (logits,)
    )
    assert torch.autograd.gradcheck(lambda z: aligned_cross_entropy(z, labels, layout.keep)[0], (logits,))


def test_mean_loss():
    total = torch.tensor(6.0, dtype=torch.float64)
    assert mean_loss(total, torch.tensor(4)).item() == 1.5
    assert mean_loss(total, torch.tensor(0)).item() == 0.0


def test_errors():
    keep = torch.ones(1, 3, dtype=torch.bool)
    logits = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        shifted_cross_entropy(logits, torch.tensor([[0, 4, 1]]), keep)
    with pytest.raises(ValueError, match="labels must be"):
        shifted_cross_entropy(logits, torch.zeros(1, 2, dtype=torch.int64), keep)
    with pytest.raises(ValueError, match="logits must be"):
        aligned_cross_entropy(torch.zeros(3, 4), torch.zeros(1, 3, dtype=torch.int64), keep)
    with pytest.raises(ValueError, match="floating point"):
        aligned_cross_entropy(torch.zeros(1, 3, 4, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64), keep)
    # An out-of-range label where nothing counts is fine.
    aligned_cross_entropy(logits, torch.tensor([[0, 1, 99]]), torch.tensor([[True, True, False]]))


@st.composite
def loss_cases(draw):
    sequence, lens, padded = draw(packed_lengths(10))
    return sequence, lens, padded, draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(loss_cases())
def test_property_shifted_matches_cross_entropy(case):
    sequence, lens, padded, seed = case
    layout = layout_from_lengths(torch.tensor(lens, dtype=torch.int64).reshape(1, -1),
                                 torch.tensor(padded, dtype=torch.int64).reshape(1, -1), sequence)
    logits = _logits(1, sequence, 5, seed=seed)
    labels = _labels(1, sequence, 5, seed=seed)
    loss_sum, count = shifted_cross_entropy(logits, labels, layout.keep, layout.document_ids)
    expected, expected_count = _reference(logits, _shift_per_document(labels, layout.keep, layout.document_ids))
    torch.testing.assert_close(loss_sum, expected, rtol=1e-13, atol=1e-15)
    assert int(count) == expected_count
