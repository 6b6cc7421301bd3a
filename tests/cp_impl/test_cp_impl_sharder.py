"""Single-process unit tests of cp_impl's sharder (a mirror of the framework's ContextParallelSharder).

Sharding runs no collective (every rank holds the same global batch), so a
stand-in mesh that only reports its size and rank lets one process produce
every rank's local batch; the shards, put back at the global positions the
index map names, must be the divisibility-padded global tensors bit for bit,
for every layout (contiguous, contiguous to a multiple of 2N, load-balanced).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cp_impl import _strategy, inkling2, mistral_large4
from cp_impl.sharder import (LAYOUTS, ContextParallelSharder, ShardLayout, contiguous_local_token_global_indices,
                             load_balanced_local_token_global_indices)


class FakeMesh:
    """A 1-D mesh stand-in named ``"cp"``: enough for sharding, which runs no collective."""

    device_type = "cpu"
    mesh_dim_names = ("cp",)

    def __init__(self, size, rank, ndim=1):
        self._size, self._rank, self.ndim = size, rank, ndim

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank

    def get_group(self):
        return None

    def __getitem__(self, name):
        assert name == "cp"
        return self


def resolve(sharder, mesh, layout=None):
    """The framework's resolution of a hook's sharder (``layout``: the same strategy cut by another layout)."""
    if layout is not None:
        sharder = _strategy.relayout(sharder, LAYOUTS[layout])
    return ContextParallelSharder(device_mesh=mesh, shard_batch=sharder.shard_batch,
                                  local_token_global_indices=sharder.local_token_global_indices)


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


def shard_all(prepare, batch, n, layout=None, **kwargs):
    """Every rank's (local batch, layout, resolved sharder), each from the same prepared global batch."""
    sharder = prepare(batch, **kwargs)["cp_sharder"]
    out = []
    for r in range(n):
        resolved = resolve(sharder, FakeMesh(n, r), layout)
        ctx_factory, local = resolved.shard(batch)
        assert ctx_factory is contextlib.nullcontext
        out.append((local, resolved.shard_layout, resolved))
    return out


def reassemble(shards, key, S_pad):
    """The local ``key`` tensors of every rank put at the global positions their index maps name."""
    first = shards[0][0][key]
    out = torch.zeros((first.shape[0], S_pad, *first.shape[2:]), dtype=first.dtype)
    seen = torch.zeros(S_pad, dtype=torch.int64)
    for local, _, resolved in shards:
        idx = resolved.local_token_global_indices(resolved._cp_mesh, S_pad, "cpu")
        out[:, idx] = local[key]
        seen[idx] += 1
    assert seen.tolist() == [1] * S_pad  # every global position owned by exactly one rank
    return out


def padded_len(S, n, layout):
    return LAYOUTS[layout or "contiguous"].padded_len(S, n)


def padded(value, S_pad, fill):
    out = torch.full((value.shape[0], S_pad, *value.shape[2:]), fill, dtype=value.dtype)
    out[:, : value.shape[1]] = value
    return out


LAYOUT_NAMES = [None, "contiguous_2n", "load_balanced"]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_inkling2_shards_reassemble_to_padded_global(n, layout):
    batch = bshd_batch(S=7)
    keep_objects = {k: batch[k] for k in ("input_ids", "image_mask", "pixel_values")}
    shards = shard_all(inkling2.prepare_cp_inputs, batch, n, layout)
    prepared_keys = set(batch)
    S, S_pad = 7, padded_len(7, n, layout)
    L = S_pad // n
    for local, shard_layout, _ in shards:
        assert shard_layout == ShardLayout(original_seq_len=S, padded_seq_len=S_pad)
        assert set(local) == {"input_ids", "labels", "image_mask", "pixel_values", "padding_mask", "position_ids"}
        for key, obj in keep_objects.items():
            assert local[key] is obj
        assert all(local[k].shape == (2, L) for k in ("labels", "padding_mask", "position_ids"))
    assert set(batch) == prepared_keys  # shard does not touch the batch
    cat = {k: reassemble(shards, k, S_pad) for k in ("labels", "padding_mask", "position_ids")}
    assert torch.equal(cat["labels"], padded(batch["labels"], S_pad, -100))
    assert torch.equal(cat["padding_mask"], padded(batch["padding_mask"], S_pad, True))
    last = batch["position_ids"][:, -1:]
    expected_pos = torch.cat([batch["position_ids"], last + torch.arange(1, S_pad - S + 1)], dim=1)
    assert torch.equal(cat["position_ids"], expected_pos)


def test_layouts_pad_and_index_as_documented():
    assert [LAYOUTS[name].padded_len(7, 3) for name in ("contiguous", "contiguous_2n", "load_balanced")] == [9, 12, 12]
    assert LAYOUTS["contiguous_2n"].padded_len(3, 1) == 4  # a multiple of 2N even on one rank, as the framework pads
    assert load_balanced_local_token_global_indices(FakeMesh(2, 0), 8, "cpu").tolist() == [0, 1, 6, 7]
    assert load_balanced_local_token_global_indices(FakeMesh(2, 1), 8, "cpu").tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible by 4"):
        load_balanced_local_token_global_indices(FakeMesh(2, 0), 6, "cpu")


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
        assert (local["input_ids"] is ids) != shard_primary
    if shard_primary:
        cat = torch.cat([s[0]["input_ids"] for s in shards], dim=1)
        assert torch.equal(cat, padded(ids, S_pad, 0))  # the framework resolves with padding_token_id=0 by default


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
        assert layout.original_seq_len == 11 and layout.padded_seq_len == S_pad


def test_constructor_mirrors_the_framework():
    sharder = inkling2.prepare_cp_inputs(bshd_batch())["cp_sharder"]
    assert isinstance(sharder, ContextParallelSharder) and sharder._cp_mesh is None and sharder.shard_layout is None
    assert sharder.local_token_global_indices is contiguous_local_token_global_indices
    with pytest.raises(TypeError, match="mutually exclusive"):
        ContextParallelSharder(batch={}, shard_batch=sharder.shard_batch)
    with pytest.raises(TypeError, match="mutually exclusive"):
        ContextParallelSharder(shard_batch=sharder.shard_batch, num_chunks=2)
    with pytest.raises(TypeError, match="require shard_batch"):
        ContextParallelSharder(local_token_global_indices=contiguous_local_token_global_indices)
    with pytest.raises(TypeError, match="batch is required"):
        ContextParallelSharder()
    with pytest.raises(NotImplementedError, match="model dispatch"):
        ContextParallelSharder(batch={})
    resolved = resolve(sharder, FakeMesh(4, 1))
    assert resolved._cp_mesh.get_local_rank() == 1 and resolved._tp_mesh is None and resolved._padding_token_id == 0
    with pytest.raises(ValueError, match="cp_mesh"):  # the strategy checks the CP mesh it is handed
        sharder.shard_batch(FakeMesh(4, 0, ndim=2), None, bshd_batch())
    with pytest.raises(TypeError, match="cp_mesh"):
        sharder.shard_batch("cp", None, bshd_batch())


def test_shard_rejects_unprepared_batch():
    sharder = resolve(inkling2.prepare_cp_inputs(bshd_batch())["cp_sharder"], None)
    with pytest.raises(ValueError, match="prepare_cp_inputs"):
        sharder.shard({"input_ids": torch.zeros(2, 7, dtype=torch.long)})


def test_loss_mask_is_sharded_when_given():
    batch = bshd_batch(S=5)
    sharder = inkling2.prepare_cp_inputs(batch)["cp_sharder"]
    loss_mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    locals_ = [ContextParallelSharder(device_mesh=FakeMesh(2, r), shard_batch=sharder.shard_batch,
                                      local_token_global_indices=sharder.local_token_global_indices,
                                      loss_mask=loss_mask).shard(batch)[1] for r in range(2)]
    assert torch.equal(torch.cat([l["loss_mask"] for l in locals_], 1), padded(loss_mask, 6, False))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_index_map_matches_slices_and_token_tensor_roundtrip(n, layout):
    batch = bshd_batch(S=6)
    sharder = inkling2.prepare_cp_inputs(batch)["cp_sharder"]
    S_pad = padded_len(6, n, layout)
    values = torch.randn(2, 6, 3, dtype=torch.float64)
    global_padded = padded(values, S_pad, 0.0)
    owned = []
    for r in range(n):
        resolved = resolve(sharder, FakeMesh(n, r), layout)
        resolved.shard(batch)
        idx = resolved.local_token_global_indices(resolved._cp_mesh, S_pad, "cpu")
        owned += idx.tolist()
        if layout is None:
            assert idx.tolist() == list(range(r * (S_pad // n), (r + 1) * (S_pad // n)))
        assert idx.dtype == torch.int64
        assert torch.equal(resolved.shard_token_tensor(values, fill=0.0), global_padded.index_select(1, idx))
        assert torch.equal(resolved.shard_token_tensor(global_padded), global_padded.index_select(1, idx))
        assert torch.equal(resolved.shard_token_tensor(values.transpose(0, 1), seq_dim=0, fill=0.0),
                           global_padded.index_select(1, idx).transpose(0, 1))
        if S_pad != 6:
            with pytest.raises(ValueError, match="fill"):  # the framework's rule: an explicit fill for padding
                resolved.shard_token_tensor(values)
    assert sorted(owned) == list(range(S_pad))
    with pytest.raises(ValueError, match="not divisible"):
        contiguous_local_token_global_indices(FakeMesh(4, 0), 6, "cpu")


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_gather_token_tensor_single_rank_trims_padding_and_is_differentiable(layout):
    batch = bshd_batch(S=6 if layout is None else 5)
    S = batch["input_ids"].shape[1]
    resolved = resolve(inkling2.prepare_cp_inputs(batch)["cp_sharder"], None, layout)
    with pytest.raises(RuntimeError, match="shard"):
        resolved.gather_token_tensor(torch.zeros(2, 6), trim=True)
    resolved.shard(batch)
    S_pad = resolved.shard_layout.padded_seq_len
    x = torch.randn(2, S, 3, requires_grad=True)
    local = resolved.shard_token_tensor(x, fill=0.0)
    assert local is not x and local.data_ptr() != x.data_ptr()
    assert torch.equal(resolved.gather_token_tensor(local.detach()), padded(x.detach(), S_pad, 0.0))
    full = resolved.gather_token_tensor(local, trim=True)
    assert torch.equal(full, x.detach())
    full.backward(torch.full_like(full, 2.0))
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    with pytest.raises(ValueError, match="padded_seq_len"):
        resolved.gather_token_tensor(torch.zeros(2, S_pad + 1), trim=True)
    with pytest.raises(ValueError, match="explicit `fill`"):
        resolved.shard_token_tensor(torch.zeros(2, S_pad + 3))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_pure_padding_slice_stays_in_autograd(layout):
    # S=2 over 4 ranks: the ranks that own only divisibility padding still take part in autograd.
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    sharder = inkling2.prepare_cp_inputs(batch)["cp_sharder"]
    x = torch.randn(1, 2, 3, requires_grad=True)
    resolved = resolve(sharder, FakeMesh(4, 3), layout)
    _, local = resolved.shard(batch)
    idx = resolved.local_token_global_indices(resolved._cp_mesh, resolved.shard_layout.padded_seq_len, "cpu")
    assert local["padding_mask"][0].tolist() == (idx >= 2).tolist()
    piece = resolved.shard_token_tensor(x, fill=0.0)
    assert piece.requires_grad
    if layout != "load_balanced":  # load-balanced rank 3 owns global position 1 (its tail chunk)
        assert torch.equal(piece, torch.zeros_like(piece))
