"""Case descriptions and the deterministic batches they stand for.

A case is a small JSON-able dict; every rank and the test process rebuild the
same tensors from it (same seed, same generator calls, same order), so only the
description travels. Keys:

- ``check``: which check runs it (``cp_harness.checks`` registry).
- ``world_size``: CP size ``N``; ``mesh``: ``"mesh"`` (default) or ``"none"``
  (pass ``mesh=None``; only with ``world_size == 1``).
- ``seed``: integer seed of every random tensor; ``dtype``: ``"float64"``, ``"float32"``,
  ``"bfloat16"`` or ``"float16"`` (the floating dtype of the payload, logits or model);
  ``value_dtype`` (data-movement checks): an integer or bool payload instead.
- ``model``: ``"inkling2"`` or ``"mistral_large4"`` (vocabulary, image format).
- ``batch``: the layout, one of
  ``{"format": "thd", "seq_len": S, "docs": [[[real, padded], ...] per row]}``
  (packed rows; ``-1000`` filler is added for rows with fewer documents) or
  ``{"format": "bshd", "seq_len": S, "rows": [[left_padding, real_len], ...]}``
  (right padding is what remains), plus optional ``eos_is_pad`` (real tokens
  whose id equals the pad id), ``padding_seed`` (random ids/labels/features in
  padding slots instead of the defaults, for metamorphic checks),
  ``given_positions`` (the batch carries ``position_ids``: correct on real
  tokens, and in padding slots random values drawn from ``padding_seed``) and
  ``images`` (inkling2: ``[[row, start, height, width], ...]``, one image per
  span; mistral_large4: ``{"height": h, "width": w, "spans": [[row, start, length], ...]}``,
  one image whose patches fill the spans in order).
- check-specific keys (``width``, ``num_chunks``, ``shard_primary``, ...).

``GENERATOR_VERSION`` changes whenever the same description would build
different tensors; golden files record it.
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from typing import Any

import torch

GENERATOR_VERSION = 1
PAD_ID = 0
FILLER = -1000
IGNORE_INDEX = -100
VOCAB_SIZE = 40
IMAGE_CHANNELS = 3
PATCH_SIZE = 2

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_PRECISION = ("bfloat16", "float16")
# Machine epsilon (one unit in the last place at 1.0) of every floating dtype a case may use; numpy has no bfloat16.
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def canonical(case: dict) -> str:
    """The case as a canonical JSON string (sorted keys, no spaces): its identity."""
    return json.dumps(case, sort_keys=True, separators=(",", ":"))


def case_id(case: dict) -> str:
    """Short stable identifier of a case (CRC32 of its canonical form)."""
    return f"{case.get('check', 'case')}-n{case.get('world_size')}-{zlib.crc32(canonical(case).encode()):08x}"


def with_changes(case: dict, **changes: Any) -> dict:
    """A deep copy of ``case`` with top-level keys replaced."""
    out = copy.deepcopy(case)
    out.update(changes)
    return out


def generator(case: dict, stream: str) -> torch.Generator:
    """A torch generator seeded by the case seed and a stream name (independent streams per tensor)."""
    return torch.Generator().manual_seed((int(case["seed"]) * 1_000_003 + zlib.crc32(stream.encode())) % (2**63))


def dtype_of(case: dict) -> torch.dtype:
    name = case.get("dtype", "float64")
    if name not in DTYPES:
        raise ValueError(f"case dtype={name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of ``dtype`` values are accumulated in: float32 for bfloat16/float16 (the contract
    of every reduction the API performs: gradient sums over ranks, the loss), else ``dtype`` itself."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def accumulate(tensors, dtype: torch.dtype) -> torch.Tensor:
    """``sum(tensors)`` as the contract defines it: accumulated in ``accumulation_dtype(dtype)``, rounded
    once to ``dtype``. With the values ``upstream_values`` draws, the float32 sum is exact in any order."""
    wide = accumulation_dtype(dtype)
    total = None
    for t in tensors:
        total = t.to(wide) if total is None else total + t.to(wide)
    assert total is not None, "accumulate needs at least one tensor"
    return total.to(dtype)


def payload_dtype(case: dict) -> str:
    """The dtype a case exercises: ``value_dtype`` (integer/bool payloads), else ``dtype``, else ``"layout"``
    for checks with no floating payload (layouts, positions)."""
    if case.get("value_dtype"):
        return str(case["value_dtype"])
    if "dtype" in case:
        return str(case["dtype"])
    return "layout"


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,3,4,8"`` as sorted unique CP sizes; ``ValueError`` saying what to give otherwise."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{text!r}: give comma-separated positive integers, e.g. 1,2,3,4,8")
    return sizes


def padded_length(seq_len: int, cp_size: int) -> int:
    """Sequence length after right-padding to a multiple of the CP size."""
    return int(math.ceil(seq_len / cp_size) * cp_size)


# ---------------------------------------------------------------------- layout, as the description states it
def layout_rows(spec: dict) -> int:
    """Rows of a layout description (packed ``docs`` rows of a THD layout, ``rows`` of a BSHD one)."""
    return len(spec["docs"] if spec["format"] == "thd" else spec["rows"])


def fixed_num_chunks(model: str, spec: dict) -> int | None:
    """The micro-batch count the contract fixes for ``model`` on layout ``spec``, ``None`` where a case may
    choose: mistral_large4's THD path takes one packed row per micro-batch (``docs/contract.md``)."""
    return layout_rows(spec) if model == "mistral_large4" and spec["format"] == "thd" else None


def spec_layout(spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep [B,S] bool, document_ids [B,S] int64)`` read straight off a batch description.

    Used to decide where the builder writes padding values; the checks take
    their expectations from ``oracle.layout`` instead.
    """
    S = int(spec["seq_len"])
    if spec["format"] == "thd":
        rows = spec["docs"]
        keep = torch.zeros(len(rows), S, dtype=torch.bool)
        docs = torch.full((len(rows), S), -1, dtype=torch.int64)
        for b, row in enumerate(rows):
            start = 0
            for d, (real, padded) in enumerate(row):
                keep[b, start : start + real] = True
                docs[b, start : start + padded] = d
                start += padded
        return keep, docs
    rows = spec["rows"]
    keep = torch.zeros(len(rows), S, dtype=torch.bool)
    for b, (left, real) in enumerate(rows):
        keep[b, left : left + real] = True
    docs = torch.where(keep, 0, -1)
    return keep, docs


def build_batch(case: dict) -> dict[str, Any]:
    """The global batch of ``case`` as the data pipeline hands it to every rank.

    Keys: ``input_ids [B,S]`` int64, ``labels [B,S]`` int64 (inkling2: aligned
    targets; mistral_large4: unshifted labels), layout metadata
    (``seq_lens``/``seq_lens_padded [B,documents]`` int64 or ``attention_mask
    [B,S]`` int64), and with images ``image_mask [B,S]`` bool plus
    ``pixel_values`` (inkling2: list of ``[C,h,w]``; mistral_large4: ``[C,H,W]``).
    Labels in padding slots are real-looking ids, not ``-100``: padding must be
    recognised from the layout, never from labels or token ids.
    """
    spec = case["batch"]
    model = case.get("model", "inkling2")
    dtype = dtype_of(case)
    S = int(spec["seq_len"])
    keep, _ = spec_layout(spec)
    B = keep.shape[0]
    g = generator(case, "tokens")
    input_ids = torch.randint(1, VOCAB_SIZE, (B, S), generator=g)
    labels = torch.randint(0, VOCAB_SIZE, (B, S), generator=g)
    ignore = torch.rand(B, S, generator=g) < 0.15
    labels = torch.where(ignore, IGNORE_INDEX, labels)
    if spec.get("eos_is_pad"):
        # Real tokens that carry the pad id: about one real token in four, drawn at random (so also,
        # often, a document's last token right before its padding).
        eos = (torch.rand(B, S, generator=g) < 0.25) & keep
        input_ids = torch.where(eos, PAD_ID, input_ids)
    if spec.get("padding_seed") is None:
        input_ids = torch.where(keep, input_ids, PAD_ID)
    else:
        gp = torch.Generator().manual_seed(int(spec["padding_seed"]))
        noise_ids = torch.randint(0, VOCAB_SIZE, (B, S), generator=gp)
        noise_labels = torch.randint(0, VOCAB_SIZE, (B, S), generator=gp)
        input_ids = torch.where(keep, input_ids, noise_ids)
        labels = torch.where(keep, labels, noise_labels)
    batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    if spec.get("given_positions"):
        batch["position_ids"] = _given_positions(spec, keep)
    if spec["format"] == "thd":
        width = max(1, max(len(row) for row in spec["docs"]))
        seq_lens = torch.full((B, width), FILLER, dtype=torch.int64)
        seq_lens_padded = torch.full((B, width), FILLER, dtype=torch.int64)
        for b, row in enumerate(spec["docs"]):
            for d, (real, padded) in enumerate(row):
                seq_lens[b, d], seq_lens_padded[b, d] = real, padded
        batch["seq_lens"], batch["seq_lens_padded"] = seq_lens, seq_lens_padded
        if spec.get("qkv_format"):
            batch["qkv_format"] = "thd"
    else:
        batch["attention_mask"] = keep.to(torch.int64)
    images = spec.get("images")
    if images:
        gi = generator(case, "images")
        image_mask = torch.zeros(B, S, dtype=torch.bool)
        pixel_values: torch.Tensor | list[torch.Tensor]  # inkling2: one tensor per image
        if model == "inkling2":
            pixel_values = []
            for row, start, h, w in images:
                n = (h // PATCH_SIZE) * (w // PATCH_SIZE)
                image_mask[row, start : start + n] = True
                pixel_values.append(torch.randn(IMAGE_CHANNELS, h, w, generator=gi, dtype=torch.float64).to(dtype))
        else:
            for row, start, length in images["spans"]:
                image_mask[row, start : start + length] = True
            pixel_values = torch.randn(
                IMAGE_CHANNELS, images["height"], images["width"], generator=gi, dtype=torch.float64
            ).to(dtype)
        batch["image_mask"] = image_mask
        batch["pixel_values"] = pixel_values
    return batch


def _given_positions(spec: dict, keep: torch.Tensor) -> torch.Tensor:
    """``position_ids [B,S]``: position inside the document on real tokens, noise in padding slots."""
    B, S = keep.shape
    positions = torch.zeros(B, S, dtype=torch.int64)
    if spec["format"] == "thd":
        for b, row in enumerate(spec["docs"]):
            start = 0
            for real, padded in row:
                positions[b, start : start + real] = torch.arange(real)
                start += padded
    else:
        for b, (left, real) in enumerate(spec["rows"]):
            positions[b, left : left + real] = torch.arange(real)
    noise = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(int(spec.get("padding_seed") or 0)))
    return torch.where(keep, positions, noise)


def clone_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a batch (tensors cloned, lists copied) to detect in-place changes."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.clone()
        elif isinstance(value, list):
            out[key] = [v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for v in value]
        else:
            out[key] = copy.deepcopy(value)
    return out


def batches_equal(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """``None`` when two batches hold the same keys and bit-identical values, else what differs."""
    if set(a) != set(b):
        return f"keys differ: added {sorted(set(a) - set(b))}, removed {sorted(set(b) - set(a))}"
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if (
                not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor))
                or x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x, y)
            ):
                return f"{key!r} changed"
        elif isinstance(x, list):
            if len(x) != len(y) or any(not torch.equal(u, v) for u, v in zip(x, y)):
                return f"{key!r} changed"
        elif x != y:
            return f"{key!r} changed"
    return None


def random_tensor(
    case: dict, stream: str, shape: tuple[int, ...], *, dtype: torch.dtype | None = None, integer_valued: bool = False
) -> torch.Tensor:
    """A seeded tensor for data-movement checks; integer-valued floats keep gradient sums exact."""
    g = generator(case, stream)
    dtype = dtype or dtype_of(case)
    if integer_valued:
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def upstream_values(
    case: dict, stream: str, shape: tuple[int, ...], *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Upstream gradients for data-movement checks, chosen so that the exact check sees how sums are formed.

    float32/float64: integers in ``[-8, 8]`` (every sum is exact in any order). bfloat16/float16: dyadic
    values ``m * 2**-e`` with ``|m| <= 255`` and ``0 <= e <= 8`` (exactly representable in both) whose
    sums of up to 16 terms need at most 20 significant bits: exact in float32 in any order, yet
    rounded when partial sums are kept in bfloat16/float16. So the contract "accumulate in float32,
    round once" gives one bit pattern, and a backward that accumulates in the payload's precision
    gives another.
    """
    dtype = dtype or dtype_of(case)
    if dtype not in (torch.bfloat16, torch.float16):
        return random_tensor(case, stream, shape, dtype=dtype, integer_valued=True)
    g = generator(case, stream)
    mantissa = torch.randint(-255, 256, shape, generator=g).to(torch.float64)
    exponent = torch.randint(0, 9, shape, generator=g).to(torch.float64)
    return (mantissa * torch.pow(2.0, -exponent)).to(dtype)
