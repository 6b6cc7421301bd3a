"""Single-rank unit tests of cp_impl's layout derivation and validation.

Global layout metadata (seq_lens, attention_mask, position_ids) is checked
here without any process group; every error must name its field and leave the
caller's batch exactly as it was.
"""

from __future__ import annotations

import pytest
import torch

from cp_impl import inkling2, mistral_large4


def snapshot(batch):
    return {k: (v, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def assert_unchanged(batch, snap):
    assert set(batch) == set(snap)
    for key, (obj, copy) in snap.items():
        assert batch[key] is obj, key
        if isinstance(copy, torch.Tensor):
            assert torch.equal(batch[key], copy), key


def packed_batch(seq_lens, seq_lens_padded, S, **extra):
    B = len(seq_lens)
    batch = {
        "input_ids": torch.arange(B * S).view(B, S) % 7,
        "labels": torch.arange(B * S).view(B, S) + 100,
        "seq_lens": torch.tensor(seq_lens),
        "seq_lens_padded": torch.tensor(seq_lens_padded),
    }
    batch.update(extra)
    return batch


# ------------------------------------------------------------- packed rows


def test_unpack_row_layout_positions_and_padding():
    batch = packed_batch([[3, 2, -1000], [4, -1000, -1000]], [[4, 3, -1000], [4, -1000, -1000]], 10, qkv_format="thd")
    ids, labels = batch["input_ids"], batch["labels"]
    ids_copy, labels_copy = ids.clone(), labels.clone()
    assert inkling2.unpack_row_layout(batch) is None
    assert set(batch) == {"input_ids", "labels", "padding_mask", "position_ids"}
    assert batch["input_ids"] is ids and torch.equal(ids, ids_copy)
    assert batch["labels"] is labels and torch.equal(labels, labels_copy)
    assert batch["padding_mask"].dtype == torch.bool and batch["position_ids"].dtype == torch.int64
    F, T = False, True
    assert batch["padding_mask"].tolist() == [
        [F, F, F, T, F, F, T, T, T, T],
        [F, F, F, F, T, T, T, T, T, T],
    ]
    # padded span keeps counting; the tail after the last document counts from 0
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 0, 1, 2],
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5],
    ]


def test_padding_never_decided_from_token_ids():
    batch = packed_batch([[2, 2]], [[2, 2]], 4)
    batch["input_ids"] = torch.zeros(1, 4, dtype=torch.long)  # every token equals the pad id
    inkling2.unpack_row_layout(batch)
    assert not batch["padding_mask"].any()


def test_unpack_accepts_agreeing_position_ids_and_writes_derived_ones():
    given = torch.tensor([[0, 1, 9, 0, 1, 7]])  # values at padding slots are free
    batch = packed_batch([[2, 2]], [[3, 2]], 6, position_ids=given.clone())
    inkling2.unpack_row_layout(batch)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]


def test_zero_length_documents_and_no_documents():
    batch = packed_batch([[0, 2, -1000], [-1000, -1000, -1000]], [[2, 2, -1000], [-1000, -1000, -1000]], 5)
    inkling2.unpack_row_layout(batch)
    assert batch["padding_mask"].tolist() == [[True, True, False, False, True], [True] * 5]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]


BAD_PACKS = [
    ({"seq_lens": [[3, -1]], "seq_lens_padded": [[3, 2]]}, ValueError, "seq_lens[0, 1]"),
    ({"seq_lens": [[3, -1000]], "seq_lens_padded": [[3, 2]]}, ValueError, "same slots"),
    ({"seq_lens": [[3, -1000, 1]], "seq_lens_padded": [[3, -1000, 1]]}, ValueError, "filler"),
    ({"seq_lens": [[4, 1]], "seq_lens_padded": [[3, 2]]}, ValueError, "exceeds seq_lens_padded"),
    ({"seq_lens": [[3, 3]], "seq_lens_padded": [[4, 4]]}, ValueError, "sums to 8"),
    ({"seq_lens": [[3, 1]], "seq_lens_padded": [[3]]}, ValueError, "same shape"),
    ({"seq_lens": [[3], [1]], "seq_lens_padded": [[3], [1]]}, ValueError, "seq_lens"),
    ({"seq_lens": [[3.0, 1.0]], "seq_lens_padded": [[3, 1]]}, TypeError, "seq_lens"),
    ({"seq_lens": [[3, 1]]}, ValueError, "seq_lens_padded"),
    ({"seq_lens": [[3, 1]], "seq_lens_padded": [[3, 1]], "position_ids": [[0, 1, 2, 1, 0, 0]]}, ValueError, "position_ids[0, 3]"),
    ({"seq_lens": [[3, 1]], "seq_lens_padded": [[3, 1]], "labels": [[1, 2, 3]]}, ValueError, "labels"),
]


@pytest.mark.parametrize("fields,error,text", BAD_PACKS)
@pytest.mark.parametrize("entry", ["unpack", "inkling2", "mistral"])
def test_malformed_packs_raise_and_leave_batch_unchanged(fields, error, text, entry):
    batch = {"input_ids": torch.arange(6).view(1, 6), "labels": torch.arange(6).view(1, 6)}
    batch.update({k: torch.tensor(v) for k, v in fields.items()})
    snap = snapshot(batch)
    call = {
        "unpack": lambda: inkling2.unpack_row_layout(batch),
        "inkling2": lambda: inkling2.prepare_cp_inputs(batch),
        "mistral": lambda: mistral_large4.prepare_cp_inputs(batch),
    }[entry]
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)
    assert_unchanged(batch, snap)


def test_unpack_requires_lengths():
    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="seq_lens"):
        inkling2.unpack_row_layout(batch)
    assert set(batch) == {"input_ids"}


# ------------------------------------------------------------ positions


@pytest.mark.parametrize(
    "keep,positions",
    [
        ([[1, 1, 1, 1]], [[5, 6, 0, 1]]),  # shard starting mid-document, then a new document
        ([[0, 0, 1, 1]], [[9, -3, 2, 3]]),  # left padding, then an offset start; padding values are free
        ([[1, 1, 0, 1]], [[0, 1, 7, 0]]),  # a gap followed by a new document
        ([[0, 0, 0, 0]], [[-1, -1, -1, -1]]),
    ],
)
def test_validate_document_positions_accepts(keep, positions):
    inkling2.validate_document_positions(torch.tensor(keep, dtype=torch.bool), torch.tensor(positions))


@pytest.mark.parametrize(
    "keep,positions,where",
    [
        ([[1, 1, 1]], [[-1, 0, 1]], "row 0, column 0"),
        ([[1, 1, 1], [1, 1, 1]], [[0, 1, 2], [0, 1, 3]], "row 1, column 2"),
        ([[1, 1, 0, 1]], [[0, 1, 2, 3]], "row 0, column 3"),  # a gap cannot resume a document
        ([[1, 1, 1]], [[3, 3, 4]], "row 0, column 1"),
    ],
)
def test_validate_document_positions_rejects(keep, positions, where):
    with pytest.raises(ValueError, match=where):
        inkling2.validate_document_positions(torch.tensor(keep, dtype=torch.bool), torch.tensor(positions))


def test_validate_document_positions_types_and_shapes():
    keep = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="keep"):
        inkling2.validate_document_positions(keep.long(), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="positions"):
        inkling2.validate_document_positions(keep, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="positions"):
        inkling2.validate_document_positions(keep, torch.zeros(1, 4, dtype=torch.long))


# ------------------------------------------------------------ BSHD rows


def test_attention_mask_rows_left_right_two_sided_and_empty():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    batch = {"input_ids": torch.zeros(4, 5, dtype=torch.long), "attention_mask": mask}
    inkling2.prepare_cp_inputs(batch)
    assert batch["attention_mask"] is mask  # left in place
    assert torch.equal(batch["padding_mask"], mask == 0)
    assert batch["position_ids"].tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
        [0, 0, 1, 2, 3],
        [0, 1, 2, 3, 4],
    ]


def test_no_metadata_means_every_token_real():
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    mistral_large4.prepare_cp_inputs(batch)
    assert not batch["padding_mask"].any()
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_given_position_ids_with_attention_mask_are_validated_and_used():
    given = torch.tensor([[0, 3, 4, 0]])
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]]),
             "position_ids": given}
    inkling2.prepare_cp_inputs(batch)
    assert batch["position_ids"] is given
    bad = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]]),
           "position_ids": torch.tensor([[0, 3, 5, 6]])}
    snap = snapshot(bad)
    with pytest.raises(ValueError, match=r"position_ids.*row 0, column 2"):
        inkling2.prepare_cp_inputs(bad)
    assert_unchanged(bad, snap)


@pytest.mark.parametrize(
    "mask,text",
    [
        ([[1, 0, 1, 1]], "row 0: real tokens resume at column 2"),
        ([[1, 2, 1, 1]], "attention_mask[0, 1]"),
    ],
)
def test_bad_attention_masks(mask, text):
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor(mask)}
    snap = snapshot(batch)
    with pytest.raises(ValueError) as info:
        mistral_large4.prepare_cp_inputs(batch)
    assert text in str(info.value)
    if "resume" in text:
        assert "seq_lens" in str(info.value)
    assert_unchanged(batch, snap)


@pytest.mark.parametrize("num_chunks,error", [(0, ValueError), (3, ValueError), (True, TypeError), (1.0, TypeError)])
def test_num_chunks_validation(num_chunks, error):
    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "attention_mask": torch.ones(4, 3, dtype=torch.long)}
    snap = snapshot(batch)
    with pytest.raises(error, match="num_chunks"):
        inkling2.prepare_cp_inputs(batch, num_chunks=num_chunks)
    assert_unchanged(batch, snap)


def test_packed_mistral_needs_one_row_per_chunk():
    batch = packed_batch([[2], [3]], [[2], [3]], 4)
    snap = snapshot(batch)
    with pytest.raises(ValueError, match=r"num_chunks=1 but the batch size is 2"):
        mistral_large4.prepare_packed_cp_inputs(batch, 1, True)
    assert_unchanged(batch, snap)
    mistral_large4.prepare_packed_cp_inputs(batch, 2, True)


@pytest.mark.parametrize(
    "extra,error,text",
    [
        ({"image_mask": torch.zeros(2, 3, dtype=torch.long)}, TypeError, "image_mask"),
        ({"pixel_values": torch.zeros(1, 3, 4, 4)}, ValueError, "pixel_values"),
        ({"labels": torch.zeros(2, 3)}, TypeError, "labels"),
        ({"inputs_embeds": torch.zeros(2, 3, 4)}, ValueError, "not both"),
    ],
)
def test_other_fields_are_checked(extra, error, text):
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), **extra}
    snap = snapshot(batch)
    with pytest.raises(error, match=text):
        mistral_large4.prepare_cp_inputs(batch)
    assert_unchanged(batch, snap)


def test_inkling2_needs_input_ids():
    with pytest.raises(ValueError, match="input_ids"):
        inkling2.prepare_cp_inputs({"inputs_embeds": torch.zeros(1, 2, 3)})


def test_prepare_is_idempotent():
    for module in (inkling2, mistral_large4):
        batch = packed_batch([[3, 2]], [[4, 3]], 8)
        module.prepare_cp_inputs(batch)
        first = {k: v.clone() for k, v in batch.items()}
        sharder = module.prepare_cp_inputs(batch)["cp_sharder"]
        assert set(batch) == set(first)
        for key in first:
            assert torch.equal(batch[key], first[key]), key
        _, local = sharder.shard(batch)  # unresolved: one rank
        assert local["padding_mask"].tolist() == [[False] * 3 + [True] + [False] * 2 + [True] * 2]
