"""Model spec: nemo-automodel 0.7.0's ``Qwen3_5MoeForConditionalGeneration`` (the ``qwen3_5_moe`` spec's tiny
model) fed **images**, CP the VLM recipe's way: ``prepare_model_inputs_for_cp`` computes the mRoPE positions on
the full sequence and selects ``shard_batch_aux_only`` (round-robin over ``2 x CP`` chunks, torch's ring
``context_parallel``); the forward embeds the full row, runs the vision tower on every image, splices the
features into their placeholders and only then keeps this rank's chunk pair (``shard_sequence_for_cp_round_robin``).

Same interface as ``qwen3_5_moe`` (whose ``build``, ``config``, ``shard`` this spec reuses: the framework's
``apply_cp``, then ``ContextParallelSharder(model, mesh, batch)``, the recipe's step); what differs:

* batches (``make_batch``, kind ``"images"``): rows of text with images as the framework's VLM collaters lay them
  out: per image ``h x w`` placeholder tokens (``image_token_id``; the tiny vision tower merges no patches,
  ``spatial_merge_size=1``), ``pixel_values [P, 12]`` (``P`` = the patches of all images in row-major order,
  ``3 x 1 x 2 x 2`` values each), ``image_grid_thw [I, 3]`` (``(1, h, w)`` per image), labels shifted with -100
  where the target is an image token (what ``datasets/vlm/collate_fns.py`` masks);
* the ring's per-step CPU kernel (``STANDINS = ("ring_sdpa_cpu",)``): torch's ring SDPA has no handler for the
  CPU flash kernel, which the stand-in adds (``docs/standins.md``); everything else is the framework's and torch's;
* ``reorder_rows``: the reference's reordered run reverses the rows, and the images with them (``pixel_values`` and
  ``image_grid_thw`` are flat over the images of all rows, in row order);
* ``pad_batch`` keeps the images (the padding check appends masked pad tokens after the last text token).

Findings (``docs/models/qwen3_5_moe_vlm.md``): M7, on these batches one device trains the image tokens at 1-D
positions while CP computes mRoPE's (so every case at CP >= 2 with an image of more than one token fails; the
``_mrope`` spec gives both sides the loader's positions); M8, the routers' load-balancing loss counts the CP
divisibility padding (rows not a multiple of ``2 x CP``; router gradients only).

Shapes: ``B`` rows, ``S`` tokens per row, ``S_local = (S padded to 2 x CP) / CP``, ``V`` vocabulary, ``I`` images,
``P`` patches.
"""

from __future__ import annotations

from typing import Any

import torch

from examples.automodel.models import _base
from examples.automodel.models import qwen3_5_moe as _qwen
from examples.automodel.models._base import *  # noqa: F403  (the shared half of the interface)
from examples.automodel.models.load_balanced_sdpa import CPU_ERROR  # the same ring, the same CPU refusal
from examples.automodel.models.qwen3_5_moe import BACKEND, VISION, parallelize  # noqa: F401

NAME = "qwen3_5_moe_vlm"
FRAMEWORK_CLASS = _qwen.FRAMEWORK_CLASS
WORLD_SIZES: tuple[int, ...] = (1, 2, 3, 4)
BATCH_KINDS: tuple[str, ...] = ("images",)
BATCH_ROWS: tuple[int, ...] = (1, 2)

# Token ids of the tiny vocabulary (64) that stand for the media markers (the released ones are ~248k).
IMAGE_TOKEN_ID = 63
VIDEO_TOKEN_ID = 62
VISION_START_TOKEN_ID = 61
VISION_END_TOKEN_ID = 60
TEXT_VOCAB = 60  # text tokens are drawn from 1 .. 59: never a media marker
MEDIA_IDS = dict(
    image_token_id=IMAGE_TOKEN_ID,
    video_token_id=VIDEO_TOKEN_ID,
    vision_start_token_id=VISION_START_TOKEN_ID,
    vision_end_token_id=VISION_END_TOKEN_ID,
)

REQUIRES: dict[str, str] = {
    "cuda": "the round-robin VLM path runs torch context_parallel's ring SDPA, which has DTensor handlers for the "
    "CUDA SDPA kernels only; on the CPU (gloo, torch 2.13) the forward fails with: " + CPU_ERROR,
}
STANDINS = ("ring_sdpa_cpu",)

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": {
        "input_ids": "[B, S] int64 token ids, image placeholders image_token_id (kept global under CP: the forward "
        "embeds and splices the whole row, then keeps this rank's chunk pair)",
        "labels": "[B, S] int64 targets, already shifted; -100 where the target is an image token",
        "pixel_values": "[P, C*T*p*p] the patches of every image of the batch, row-major (global under CP)",
        "image_grid_thw": "[I, 3] int64 (t, h, w) patches of every image, in placeholder order (global under CP)",
    },
    "optional": {"attention_mask": "[B, S] 1 (the collater's; the CP sharder drops it)"},
    "produced_by_sharder": {
        "position_ids": "[3, B, S_local] mRoPE positions of the full sequence (get_rope_index), round-robin sharded",
        "labels": "[B, S_local] round-robin sharded",
    },
}

_SHARDER = "nemo_automodel.components.distributed.context_parallel.sharder."
COVERS: dict[str, str] = {
    "nemo_automodel.components.moe.parallelizer.apply_cp": "the recipe's CP parallelization step: model.cp_mesh, _cp_enabled, the MoE blocks' cp_mesh",
    "nemo_automodel.components.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration.prepare_model_inputs_for_cp": "the model's CP hook: mRoPE positions of the full row with its images (get_rope_index), selects shard_batch_aux_only",
    _SHARDER
    + "shard_batch_aux_only": "pads labels / mRoPE positions to 2 x CP and round-robin shards them; input_ids and the media stay global; the ring context",
    "nemo_automodel.components.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration._embed_and_splice_for_cp": "in the forward: the full row embedded, the vision tower on every image (ring dispatcher suspended), features spliced into the placeholders",
    _SHARDER
    + "shard_sequence_for_cp_round_robin": "in the forward: the spliced embeddings padded and this rank's chunk pair kept (differentiable: gradients reach the embeddings and the vision tower)",
    _SHARDER + "round_robin_local_indices": "this rank's global positions (the sharder's index map)",
    **_base.COVERS_GATHER_BY_INDICES,
}


def config(dtype: torch.dtype = torch.float32, **overrides: Any):
    """The ``qwen3_5_moe`` tiny config with this spec's media token ids (in the 64-token vocabulary)."""
    cfg = _qwen.config(dtype, **overrides)
    for key, value in MEDIA_IDS.items():
        setattr(cfg, key, value)
    return cfg


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``qwen3_5_moe.build`` with the media token ids of ``MEDIA_IDS`` (vision tower: 1 block, hidden 8, patch 2,
    no temporal patching, no merging); parameters in ``dtype``, train mode, seeded."""
    model = _base.build_seeded(
        lambda: _qwen.Qwen3_5MoeForConditionalGeneration(
            config(dtype, **overrides), backend=_qwen.BackendConfig(**BACKEND)
        ),
        dtype,
        seed,
    )
    _qwen._PRISTINE[model] = _qwen._snapshot(model)
    return model


forward = _base.forward


def shard(model: torch.nn.Module, mesh: Any, batch: dict[str, Any], padding_token_id: int = 0):
    """``qwen3_5_moe.shard`` (the framework's ``apply_cp``, then ``ContextParallelSharder(model, mesh, batch)`` +
    ``shard``) on fresh copies of the batch's tensors, as the loader hands the recipe a new batch every step: torch's
    ``context_parallel`` shards ``labels`` and the positions in place (finding S2), which would change the caller's
    global batch. Returns ``(ctx_factory, local_batch, sharder)``; inside ``ctx_factory()`` the local ``labels`` are
    ``[B, S_local]`` and ``position_ids`` ``[3, B, S_local]``; ``input_ids`` and the media stay global."""
    return _qwen.shard(model, mesh, _base.batch_to(batch, torch.device("cpu")), padding_token_id)


def valid_positions(batch: dict[str, Any]) -> torch.Tensor:
    """Bool ``[B, S]``: every position of the row whose logits are defined (the attention mask's real tokens)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return mask.bool()
    return torch.ones_like(batch["input_ids"], dtype=torch.bool)


# The fake image of a text-only row (``fake_images``): [start, h, w], at the row's start as the framework puts it in
# the first user message (``inject_fake_image_into_conversation``; its 56 x 56 white image, here 2 x 2 patches of 1).
FAKE_IMAGE = (0, 2, 2)
MEDIA = ("pixel_values", "image_grid_thw")  # flat over the images of all rows
PATCH_VALUES = 3 * 1 * 2 * 2  # in_channels x temporal_patch_size x patch_size^2 of ``VISION``


def _check_images(images: Any, rows: int, seq_len: int) -> list[list[tuple[int, int, int]]]:
    """``images[row]``: ``[start, h, w]`` per image, placed at ``start`` with ``h x w`` placeholders; raises
    ``ValueError`` naming what is wrong (overlap, outside the row, no text between two images, no label left)."""
    if not isinstance(images, (list, tuple)) or len(images) != rows:
        raise ValueError(f"{NAME}: images must give one list of [start, h, w] per row ({rows} rows), got {images!r}")
    out = []
    for row, placed in enumerate(images):
        spans, end = [], -1
        for item in sorted((tuple(int(x) for x in image) for image in placed), key=lambda t: t[0]):
            if len(item) != 3 or min(item[1:]) < 1 or item[0] < 0:
                raise ValueError(f"{NAME}: row {row}: image {item!r} is not [start >= 0, h >= 1, w >= 1]")
            start, h, w = item
            if start <= end:  # the model groups adjacent placeholders into one image: keep a text token between
                raise ValueError(
                    f"{NAME}: row {row}: image at {start} touches or overlaps the previous one (ends {end - 1})"
                )
            if start + h * w > seq_len:
                raise ValueError(f"{NAME}: row {row}: image at {start} of {h * w} tokens exceeds the row of {seq_len}")
            spans.append(item)
            end = start + h * w
        out.append(spans)
    return out


def make_batch(
    kind: str,
    seq_len: int,
    *,
    batch_size: int = 1,
    seed: int = 0,
    images: list[list[list[int]]] | None = None,
    fake_images: bool = False,
    **unused: Any,
) -> dict[str, Any]:
    """A VLM batch (kind ``"images"``) with shifted labels.

    ``images[row]``: ``[start, h, w]`` per image of that row (``h x w`` placeholder tokens from ``start``; default
    one 2 x 2 image at ``seq_len // 3``). ``fake_images``: each row given no image gets the framework's VLM data
    path's fake image instead (``FAKE_IMAGE``: ``inject_fake_images``, a constant image at the row's start, its
    placeholders' ``attention_mask`` set to 0 as the framework's ``mask_fake_vision_tokens_batch`` sets it), which the
    framework injects into text-only samples so that FSDP's vision-tower units run on every rank. Returns ``input_ids``/``labels``/``attention_mask [B, S]``,
    ``pixel_values [P, 12]`` (seeded, float32: the model casts them to its tower's dtype), ``image_grid_thw [I, 3]``.
    """
    if kind != "images":
        raise ValueError(f"{NAME}: unknown batch kind {kind!r} (supported: {BATCH_KINDS})")
    if images is None:
        images = [[[seq_len // 3, 2, 2]]] * batch_size
    placed = _check_images(images, batch_size, seq_len)
    fake = [row for row, spans in enumerate(placed) if fake_images and not spans]
    for row in fake:
        placed[row] = [FAKE_IMAGE]
    placed = _check_images(placed, batch_size, seq_len)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, TEXT_VOCAB, (batch_size, seq_len), generator=generator)
    grids = []
    for row, spans in enumerate(placed):
        for start, h, w in spans:
            input_ids[row, start : start + h * w] = IMAGE_TOKEN_ID
            grids.append((1, h, w))
    if not grids:
        raise ValueError(f"{NAME}: an images batch needs at least one image")
    labels = torch.full_like(input_ids, IGNORE_INDEX)  # noqa: F405
    labels[:, :-1] = input_ids[:, 1:]
    labels[labels == IMAGE_TOKEN_ID] = IGNORE_INDEX  # noqa: F405
    if not (labels != IGNORE_INDEX).any():  # noqa: F405
        raise ValueError(f"{NAME}: images {images!r} leave no text target in the batch")
    pixel_values = torch.cat(
        [
            torch.ones(h * w, PATCH_VALUES) if row in fake else torch.randn(h * w, PATCH_VALUES, generator=generator)
            for row, spans in enumerate(placed)
            for _, h, w in spans
        ]
    )
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor(grids, dtype=torch.long),
    }
    for row in fake:  # mask_fake_vision_tokens_batch's line, rebuilt: datasets/vlm needs HF datasets (absent here)
        batch["attention_mask"][row][torch.isin(input_ids[row], torch.tensor(list(MEDIA_IDS.values())))] = 0
    return batch


def _images_per_row(batch: dict[str, Any]) -> list[list[int]]:
    """The indices into ``image_grid_thw`` ``[I, 3]`` of each row's images, in placeholder order (row-major), from
    the placeholder runs of ``input_ids``; raises ``ValueError`` when the runs do not match the grids."""
    grids = batch["image_grid_thw"]
    sizes = (grids[:, 0] * grids[:, 1] * grids[:, 2]).tolist()
    rows, index = [], 0
    for ids in batch["input_ids"]:
        is_image = (ids == IMAGE_TOKEN_ID).tolist()
        own, position = [], 0
        while position < len(is_image):
            if not is_image[position]:
                position += 1
                continue
            run = 0
            while position + run < len(is_image) and is_image[position + run]:
                run += 1
            if index >= len(sizes) or sizes[index] != run:
                raise ValueError(f"{NAME}: a run of {run} image tokens does not match image_grid_thw {grids.tolist()}")
            own.append(index)
            index, position = index + 1, position + run
        rows.append(own)
    if index != len(sizes):
        raise ValueError(f"{NAME}: {len(sizes)} grids for {index} placeholder runs")
    return rows


def reorder_rows(batch: dict[str, Any], order: list[int]) -> dict[str, Any]:
    """``batch`` with its rows in ``order``, the images with them: ``input_ids``/``labels``/``attention_mask``
    ``[B, S]`` indexed by ``order``; ``image_grid_thw [I, 3]`` and ``pixel_values [P, 12]`` rebuilt from the images
    of the rows in the new order (their patches stay contiguous per image). ``order`` may name a subset of the rows
    (a data-parallel rank's rows); when those rows hold no image the result has no media keys, as the framework's
    collaters leave a text-only batch."""
    if batch.get("image_grid_thw") is None:  # a text-only batch (rows without images): rows only
        return {k: (v[order] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    per_row = _images_per_row(batch)
    grids = batch["image_grid_thw"]
    sizes = (grids[:, 0] * grids[:, 1] * grids[:, 2]).tolist()
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    images = [i for row in order for i in per_row[row]]
    out = {k: (v[order] if isinstance(v, torch.Tensor) and k not in MEDIA else v) for k, v in batch.items()}
    if not images:  # text-only rows: no pixel_values [0, C] / image_grid_thw [0, 3] (torch.cat of nothing)
        return {k: v for k, v in out.items() if k not in MEDIA}
    out["image_grid_thw"] = grids[images]
    out["pixel_values"] = torch.cat([batch["pixel_values"][starts[i] : starts[i + 1]] for i in images])
    return out


def pad_batch(batch: dict[str, Any], length: int) -> dict[str, Any]:
    """``_base.pad_batch`` (masked pad tokens appended up to ``length``) with the images kept."""
    return {**_base.pad_batch(batch, length), **{k: batch[k] for k in MEDIA}}


def cp_padded_length(model: Any, seq_len: int, cp_size: int) -> int:
    """Global length a row of ``seq_len`` is padded to at ``cp_size``: a multiple of ``2 x cp_size``."""
    return _base.padded_length(seq_len, cp_size, 2 * cp_size)
