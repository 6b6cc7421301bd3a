"""Single-process unit tests of cp_impl's sharder.

Sharding runs no collective (every rank holds the same global batch), so a
stand-in mesh that only reports its size and rank lets one process produce
every rank's local batch; the shards, put back together in rank order, must
be the divisibility-padded global tensors bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cp_impl import inkling2, mistral_large4
from cp_impl.sharder import ContextParallelSharder, ShardLayout, contiguous_local_token_global_indices


class FakeMesh:
    """A 1-D mesh stand-in: enough for sharding, which runs no collective."""

    device_type = "cpu"

    def __init__(self, size, rank, ndim=1):
        self._size, self._rank, self.ndim = size, rank, ndim

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank

    def get_group(self):
        return None


def bshd_batch(B=2, S=7, seed=0, single_image=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0
    return {
        "input_ids": torch.randint(1, 50, (B, S), generator=g),
        "labels": torch.randint(0, 50, (B, S), generator=g),
        "attention_mask": mask,
        "image_mask": torch.rand(B, S, generator=g) < 0.3,
        # mistral_large4: one complete image; inkling2: a list of images
        "pixel_values": torch.randn(3, 4, 4, generator=g) if single_image else [torch.randn(3, 4, 4, generator=g)],
    }


def shard_all(prepare, batch, n, **kwargs):
    """Every rank's (local batch, layout), each from the same prepared global batch."""
    sharder = prepare(batch, **kwargs)["cp_sharder"]
    out = []
    for r in range(n):
        bound = sharder.bind(FakeMesh(n, r) if n > 1 else None)
        ctx_factory, local = bound.shard(batch)
        assert ctx_factory is contextlib.nullcontext
        out.append((local, bound.shard_layout, bound))
    return out


def padded(value, S_pad, fill):
    out = torch.full((value.shape[0], S_pad, *value.shape[2:]), fill, dtype=value.dtype)
    out[:, : value.shape[1]] = value
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_inkling2_shards_reassemble_to_padded_global(n):
    batch = bshd_batch(S=7)
    keep_objects = {k: batch[k] for k in ("input_ids", "image_mask", "pixel_values")}
    shards = shard_all(inkling2.prepare_cp_inputs, batch, n)
    prepared_keys = set(batch)
    S, S_pad = 7, -(-7 // n) * n
    L = S_pad // n
    for r, (local, layout, _) in enumerate(shards):
        assert layout == ShardLayout(
            original_seq_len=S, padded_seq_len=S_pad, local_seq_len=L, cp_size=n, cp_rank=r, batch_size=2,
            num_chunks=1, sharded_keys=("labels", "padding_mask", "position_ids"),
            global_keys=("input_ids", "image_mask", "pixel_values"),
        )
        assert set(local) == {"input_ids", "labels", "image_mask", "pixel_values", "padding_mask", "position_ids"}
        for key, obj in keep_objects.items():
            assert local[key] is obj
        assert all(local[k].shape == (2, L) for k in ("labels", "padding_mask", "position_ids"))
    assert set(batch) == prepared_keys  # shard does not touch the batch
    cat = {k: torch.cat([s[0][k] for s in shards], dim=1) for k in ("labels", "padding_mask", "position_ids")}
    assert torch.equal(cat["labels"], padded(batch["labels"], S_pad, -100))
    assert torch.equal(cat["padding_mask"], padded(batch["padding_mask"], S_pad, True))
    last = batch["position_ids"][:, -1:]
    expected_pos = torch.cat([batch["position_ids"], last + torch.arange(1, S_pad - S + 1)], dim=1)
    assert torch.equal(cat["position_ids"], expected_pos)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("shard_primary", [True, False])
def test_mistral_bshd_shards(n, shard_primary):
    batch = bshd_batch(S=10, single_image=True)
    ids = batch["input_ids"]
    shards = shard_all(mistral_large4.prepare_cp_inputs, batch, n, shard_primary=shard_primary)
    S_pad = -(-10 // n) * n
    for local, layout, _ in shards:
        assert "attention_mask" not in local
        assert local["pixel_values"] is batch["pixel_values"] and local["image_mask"] is batch["image_mask"]
        assert ("input_ids" in layout.sharded_keys) == shard_primary
        if not shard_primary:
            assert local["input_ids"] is ids
    if shard_primary:
        cat = torch.cat([s[0]["input_ids"] for s in shards], dim=1)
        assert torch.equal(cat, padded(ids, S_pad, 0))  # hooks build the sharder with padding_token_id=0


def test_mistral_inputs_embeds_pad_with_zeros_and_stay_differentiable():
    embeds = torch.randn(1, 5, 3, requires_grad=True)
    batch = {"inputs_embeds": embeds, "labels": torch.zeros(1, 5, dtype=torch.long)}
    shards = shard_all(mistral_large4.prepare_cp_inputs, batch, 4)
    cat = torch.cat([s[0]["inputs_embeds"] for s in shards], dim=1)
    assert torch.equal(cat.detach(), padded(embeds.detach(), 8, 0.0))
    cat.sum().backward()
    assert torch.equal(embeds.grad, torch.ones(1, 5, 3))


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_mistral_packed_document_ids_and_first_token_labels(n):
    batch = {
        "input_ids": torch.arange(11).view(1, 11),
        "labels": torch.arange(11).view(1, 11) + 10,
        "seq_lens": torch.tensor([[3, 2, 1]]),
        "seq_lens_padded": torch.tensor([[4, 2, 2]]),
    }
    labels = batch["labels"]
    labels_copy = labels.clone()
    shards = shard_all(mistral_large4.prepare_cp_inputs, batch, n)
    assert set(batch) == {"input_ids", "labels", "padding_mask", "position_ids", "document_ids"}
    assert batch["labels"] is labels and torch.equal(labels, labels_copy)
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, -1, -1, -1]]
    S_pad = -(-11 // n) * n
    pad = S_pad - 11
    cat = {k: torch.cat([s[0][k] for s in shards], dim=1)[0].tolist() for k in ("document_ids", "labels", "padding_mask")}
    assert cat["document_ids"] == [0, 0, 0, 0, 1, 1, 2, 2, -1, -1, -1] + [-1] * pad
    assert cat["labels"] == [-100, 11, 12, 13, -100, 15, -100, 17, 18, 19, 20] + [-100] * pad
    assert cat["padding_mask"] == [False] * 3 + [True] + [False] * 3 + [True] * 4 + [True] * pad
    for local, layout, _ in shards:
        assert "document_ids" in layout.sharded_keys and layout.num_chunks == 1


def test_shard_requires_bind_and_bind_returns_copy():
    sharder = inkling2.prepare_cp_inputs(bshd_batch())["cp_sharder"]
    assert isinstance(sharder, ContextParallelSharder) and not sharder.is_bound
    with pytest.raises(RuntimeError, match="bind"):
        sharder.shard(bshd_batch())
    bound = sharder.bind(None)
    assert bound is not sharder and bound.is_bound and not sharder.is_bound
    with pytest.raises(ValueError, match="cp_mesh"):
        sharder.bind(FakeMesh(4, 0, ndim=2))
    with pytest.raises(TypeError, match="cp_mesh"):
        sharder.bind("cp")


def test_shard_rejects_unprepared_batch():
    sharder = inkling2.prepare_cp_inputs(bshd_batch())["cp_sharder"].bind(None)
    with pytest.raises(ValueError, match="prepare_cp_inputs"):
        sharder.shard({"input_ids": torch.zeros(2, 7, dtype=torch.long)})


def test_loss_mask_is_sharded_when_given():
    batch = bshd_batch(S=5)
    sharder = inkling2.prepare_cp_inputs(batch)["cp_sharder"]
    loss_mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    locals_ = [sharder.bind(FakeMesh(2, r)).shard(batch, loss_mask=loss_mask)[1] for r in range(2)]
    assert torch.equal(torch.cat([l["loss_mask"] for l in locals_], 1), padded(loss_mask, 6, False))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_index_map_matches_slices_and_token_tensor_roundtrip(n):
    batch = bshd_batch(S=6)
    sharder = inkling2.prepare_cp_inputs(batch)["cp_sharder"]
    S_pad = -(-6 // n) * n
    values = torch.randn(2, 6, 3, dtype=torch.float64)
    global_padded = padded(values, S_pad, 0.0)
    for r in range(n):
        bound = sharder.bind(FakeMesh(n, r) if n > 1 else None)
        bound.shard(batch)
        idx = contiguous_local_token_global_indices(bound.cp_mesh, S_pad, "cpu")
        assert idx.dtype == torch.int64 and idx.tolist() == list(range(r * (S_pad // n), (r + 1) * (S_pad // n)))
        assert torch.equal(bound.local_token_global_indices(bound.cp_mesh, S_pad, "cpu"), idx)
        assert torch.equal(bound.shard_token_tensor(values), global_padded.index_select(1, idx))
        assert torch.equal(bound.shard_token_tensor(values.transpose(0, 1), seq_dim=0),
                           global_padded.index_select(1, idx).transpose(0, 1))
    with pytest.raises(ValueError, match="not divisible"):
        contiguous_local_token_global_indices(FakeMesh(4, 0), 6, "cpu")


def test_gather_token_tensor_single_rank_drops_padding_and_is_differentiable():
    batch = bshd_batch(S=6)
    bound = inkling2.prepare_cp_inputs(batch)["cp_sharder"].bind(None)
    with pytest.raises(RuntimeError, match="shard"):
        bound.gather_token_tensor(torch.zeros(2, 6))
    bound.shard(batch)
    x = torch.randn(2, 6, 3, requires_grad=True)
    local = bound.shard_token_tensor(x)
    assert local is not x and local.data_ptr() != x.data_ptr()
    full = bound.gather_token_tensor(local)
    assert torch.equal(full, x.detach())
    full.backward(torch.full_like(full, 2.0))
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    with pytest.raises(ValueError, match="local slice"):
        bound.gather_token_tensor(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="tokens along seq_dim"):
        bound.shard_token_tensor(torch.zeros(2, 9))


def test_pure_padding_slice_stays_in_autograd():
    # S=2 over 4 ranks: ranks 2 and 3 own only divisibility padding.
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    sharder = inkling2.prepare_cp_inputs(batch)["cp_sharder"]
    x = torch.randn(1, 2, 3, requires_grad=True)
    bound = sharder.bind(FakeMesh(4, 3))
    _, local = bound.shard(batch)
    assert local["padding_mask"].tolist() == [[True]]
    piece = bound.shard_token_tensor(x)
    assert piece.requires_grad and torch.equal(piece, torch.zeros(1, 1, 3))
