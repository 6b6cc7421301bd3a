"""Oracle layouts: hand-written examples, malformed metadata, and a property
check against an independent construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.layout import (
    FILLER,
    IGNORE_INDEX,
    Layout,
    layout_from_attention_mask,
    layout_from_batch,
    layout_from_lengths,
)

F = FILLER


def _t(rows):
    return torch.tensor(rows, dtype=torch.int64)


def _assert_layout(layout: Layout, keep, document_ids, positions):
    """Compare a layout with expected rows; positions are compared at kept slots only."""
    keep = torch.tensor(keep, dtype=torch.bool)
    assert torch.equal(layout.keep, keep)
    assert torch.equal(layout.document_ids, _t(document_ids))
    assert layout.keep.dtype == torch.bool
    assert layout.document_ids.dtype == torch.int64
    assert layout.positions.dtype == torch.int64
    assert torch.equal(layout.positions[keep], _t(positions)[keep])
    # The documented padding value.
    assert torch.equal(layout.positions[~keep], torch.zeros_like(layout.positions[~keep]))


def test_constants():
    assert FILLER == -1000
    assert IGNORE_INDEX == -100


# ---------------------------------------------------------------- lengths


def test_lengths_hand_example_with_empty_document_and_tail():
    layout = layout_from_lengths(_t([[3, 0, 2, F]]), _t([[4, 2, 2, F]]), 10)
    _assert_layout(
        layout,
        keep=[[1, 1, 1, 0, 0, 0, 1, 1, 0, 0]],
        document_ids=[[0, 0, 0, 0, 1, 1, 2, 2, -1, -1]],
        positions=[[0, 1, 2, 0, 0, 0, 0, 1, 0, 0]],
    )


def test_lengths_one_token_documents():
    layout = layout_from_lengths(_t([[1, 1, 1]]), _t([[1, 1, 1]]), 4)
    _assert_layout(
        layout,
        keep=[[1, 1, 1, 0]],
        document_ids=[[0, 1, 2, -1]],
        positions=[[0, 0, 0, 0]],
    )


def test_lengths_rows_with_different_document_counts_and_an_empty_row():
    layout = layout_from_lengths(
        _t([[2, 3], [F, F], [0, F]]),
        _t([[2, 3], [F, F], [0, F]]),
        6,
    )
    _assert_layout(
        layout,
        keep=[[1, 1, 1, 1, 1, 0], [0] * 6, [0] * 6],
        document_ids=[[0, 0, 1, 1, 1, -1], [-1] * 6, [-1] * 6],
        positions=[[0, 1, 0, 1, 2, 0], [0] * 6, [0] * 6],
    )


def test_lengths_exactly_full_row_and_zero_documents():
    layout = layout_from_lengths(_t([[2, 2]]), _t([[3, 3]]), 6)
    _assert_layout(
        layout,
        keep=[[1, 1, 0, 1, 1, 0]],
        document_ids=[[0, 0, 0, 1, 1, 1]],
        positions=[[0, 1, 0, 0, 1, 0]],
    )
    empty = layout_from_lengths(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64), 3)
    _assert_layout(empty, keep=[[0] * 3] * 2, document_ids=[[-1] * 3] * 2, positions=[[0] * 3] * 2)


def test_lengths_accept_python_lists():
    layout = layout_from_lengths([[2]], [[3]], 4)
    _assert_layout(layout, keep=[[1, 1, 0, 0]], document_ids=[[0, 0, 0, -1]], positions=[[0, 1, 0, 0]])


@pytest.mark.parametrize(
    "seq_lens, seq_lens_padded, sequence, words",
    [
        ([[2, -3]], [[2, 3]], 8, ["seq_lens[0, 1]", "negative"]),
        ([[2, 3]], [[2, -1]], 8, ["seq_lens_padded[0, 1]", "negative"]),
        ([[2, F, 3]], [[2, F, 3]], 8, ["seq_lens[0, 2]", "after the filler"]),
        ([[2, F]], [[2, 3]], 8, ["row 0, document 1", "same slots"]),
        ([[2, 3]], [[2, F]], 8, ["row 0, document 1", "same slots"]),
        ([[1], [4]], [[1], [3]], 8, ["row 1, document 0", "exceeds seq_lens_padded"]),
        ([[2, 3]], [[4, 5]], 8, ["row 0", "sum of seq_lens_padded = 9", "sequence length 8"]),
        ([[2, 3]], [[2, 3, 0]], 8, ["seq_lens has shape (1, 2)", "seq_lens_padded has shape (1, 3)"]),
        ([2, 3], [2, 3], 8, ["seq_lens must be 2-D"]),
        ([[2.0]], [[2.0]], 8, ["seq_lens must hold integers"]),
    ],
)
def test_lengths_malformed(seq_lens, seq_lens_padded, sequence, words):
    with pytest.raises(ValueError) as info:
        layout_from_lengths(torch.tensor(seq_lens), torch.tensor(seq_lens_padded), sequence)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("sequence", [-1, 2.5, True, "4"])
def test_lengths_bad_sequence_length(sequence):
    with pytest.raises(ValueError, match="sequence_length must be a non-negative int"):
        layout_from_lengths(_t([[1]]), _t([[1]]), sequence)


# ---------------------------------------------------------- attention_mask


def test_mask_left_right_two_sided_full_and_empty_rows():
    mask = _t(
        [
            [0, 0, 1, 1, 1],  # left padding
            [1, 1, 1, 0, 0],  # right padding
            [0, 1, 1, 0, 0],  # both sides
            [1, 1, 1, 1, 1],  # no padding
            [0, 0, 0, 0, 0],  # all padding
            [0, 0, 0, 0, 1],  # one token at the end
        ]
    )
    layout = layout_from_attention_mask(mask)
    _assert_layout(
        layout,
        keep=mask.tolist(),
        document_ids=[
            [-1, -1, 0, 0, 0],
            [0, 0, 0, -1, -1],
            [-1, 0, 0, -1, -1],
            [0, 0, 0, 0, 0],
            [-1, -1, -1, -1, -1],
            [-1, -1, -1, -1, 0],
        ],
        positions=[
            [0, 0, 0, 1, 2],
            [0, 1, 2, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 1, 2, 3, 4],
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
        ],
    )
    bool_layout = layout_from_attention_mask(mask.to(torch.bool))
    assert torch.equal(bool_layout.keep, layout.keep)
    assert torch.equal(bool_layout.document_ids, layout.document_ids)
    assert torch.equal(bool_layout.positions, layout.positions)


def test_mask_gap_names_row_and_column():
    with pytest.raises(ValueError) as info:
        layout_from_attention_mask(_t([[1, 1, 1], [0, 1, 0], [1, 0, 1]]))
    message = str(info.value)
    assert "row 2" in message and "column 1" in message and "seq_lens" in message


@pytest.mark.parametrize(
    "mask, words",
    [
        ([[1, 2]], ["attention_mask[0, 1] = 2"]),
        ([1, 1], ["2-D"]),
        ([[1.0, 1.0]], ["int or bool"]),
    ],
)
def test_mask_malformed(mask, words):
    with pytest.raises(ValueError) as info:
        layout_from_attention_mask(torch.tensor(mask))
    for word in words:
        assert word in str(info.value)


# ------------------------------------------------------------------- batch

PAD = 0  # pad id; also used as the EOS id below


def test_batch_eos_equal_to_pad_id_stays_real_with_attention_mask():
    input_ids = _t([[PAD, PAD, 5, 7, PAD], [5, 7, PAD, PAD, PAD]])  # real EOS = PAD at the end
    attention_mask = _t([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    layout = layout_from_batch({"input_ids": input_ids, "attention_mask": attention_mask})
    assert torch.equal(layout.keep, attention_mask.to(torch.bool))
    assert bool(layout.keep[0, 4]) and bool(layout.keep[1, 2])


def test_batch_eos_equal_to_pad_id_stays_real_with_seq_lens():
    input_ids = _t([[5, PAD, 6, 7, PAD, PAD]])  # doc 0 = [5, EOS], doc 1 = [6, 7, EOS]
    layout = layout_from_batch(
        {"input_ids": input_ids, "seq_lens": _t([[2, 3]]), "seq_lens_padded": _t([[2, 3]])}
    )
    _assert_layout(
        layout,
        keep=[[1, 1, 1, 1, 1, 0]],
        document_ids=[[0, 0, 1, 1, 1, -1]],
        positions=[[0, 1, 0, 1, 2, 0]],
    )


def test_batch_without_layout_keys_is_one_real_document_per_row():
    layout = layout_from_batch({"input_ids": torch.full((2, 4), PAD)})
    _assert_layout(layout, keep=[[1] * 4] * 2, document_ids=[[0] * 4] * 2, positions=[[0, 1, 2, 3]] * 2)


def test_batch_seq_lens_win_over_attention_mask_and_inputs_embeds_give_the_length():
    batch = {
        "inputs_embeds": torch.zeros(1, 5, 3),
        "seq_lens": _t([[2]]),
        "seq_lens_padded": _t([[3]]),
        "attention_mask": torch.ones(1, 5, dtype=torch.int64),
    }
    layout = layout_from_batch(batch)
    _assert_layout(layout, keep=[[1, 1, 0, 0, 0]], document_ids=[[0, 0, 0, -1, -1]], positions=[[0, 1, 0, 0, 0]])


def test_batch_errors():
    with pytest.raises(ValueError, match="seq_lens_padded"):
        layout_from_batch({"input_ids": torch.zeros(1, 4, dtype=torch.int64), "seq_lens": _t([[2]])})
    with pytest.raises(ValueError, match="input_ids nor inputs_embeds"):
        layout_from_batch({"attention_mask": torch.ones(1, 4)})
    with pytest.raises(ValueError, match="attention_mask has shape"):
        layout_from_batch({"input_ids": torch.zeros(1, 4, dtype=torch.int64), "attention_mask": torch.ones(1, 5)})
    with pytest.raises(ValueError, match="seq_lens has 2 rows"):
        layout_from_batch(
            {"input_ids": torch.zeros(1, 4, dtype=torch.int64), "seq_lens": _t([[1], [1]]), "seq_lens_padded": _t([[1], [1]])}
        )


# ---------------------------------------------------------------- property


@st.composite
def packed_rows(draw):
    sequence = draw(st.integers(0, 12))
    batch = draw(st.integers(1, 3))
    documents = draw(st.integers(0, 4))
    lens, padded = [], []
    for _ in range(batch):
        count = draw(st.integers(0, documents))
        row_real, row_padded, budget = [], [], sequence
        for _ in range(count):
            p = draw(st.integers(0, budget))
            r = draw(st.integers(0, p))
            budget -= p
            row_real.append(r)
            row_padded.append(p)
        lens.append(row_real + [F] * (documents - count))
        padded.append(row_padded + [F] * (documents - count))
    return _t(lens).reshape(batch, documents), _t(padded).reshape(batch, documents), sequence


def _reference_layout(seq_lens, seq_lens_padded, sequence):
    """Independent construction: one flat list of slot labels per row."""
    keep, docs, positions = [], [], []
    for real_row, padded_row in zip(seq_lens.tolist(), seq_lens_padded.tolist()):
        k, d, p = [], [], []
        for index, (real, padded) in enumerate(zip(real_row, padded_row)):
            if real == F:
                continue
            k += [True] * real + [False] * (padded - real)
            d += [index] * padded
            p += list(range(real)) + [None] * (padded - real)
        tail = sequence - len(k)
        keep.append(k + [False] * tail)
        docs.append(d + [-1] * tail)
        positions.append(p + [None] * tail)
    return keep, docs, positions


@settings(max_examples=60, deadline=None)
@given(packed_rows())
def test_lengths_property_against_independent_construction(case):
    seq_lens, seq_lens_padded, sequence = case
    layout = layout_from_lengths(seq_lens, seq_lens_padded, sequence)
    keep, docs, positions = _reference_layout(seq_lens, seq_lens_padded, sequence)
    assert layout.keep.tolist() == keep
    assert layout.document_ids.tolist() == docs
    for b, row in enumerate(positions):
        for s, expected in enumerate(row):
            if expected is not None:
                assert int(layout.positions[b, s]) == expected
    # Cross-check: a kept token has position 0 exactly where its document starts.
    for b in range(layout.keep.shape[0]):
        previous_doc = None
        for s in range(sequence):
            if layout.keep[b, s]:
                doc = int(layout.document_ids[b, s])
                assert (int(layout.positions[b, s]) == 0) == (doc != previous_doc)
                previous_doc = doc


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8))
def test_mask_property_two_sided(left, real, right):
    mask = _t([[0] * left + [1] * real + [0] * right])
    layout = layout_from_attention_mask(mask)
    assert layout.keep.tolist() == [[False] * left + [True] * real + [False] * right]
    assert layout.document_ids.tolist() == [[-1] * left + [0] * real + [-1] * right]
    assert layout.positions[0, left : left + real].tolist() == list(range(real))
