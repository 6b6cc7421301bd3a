"""What the model specs share: building a tiny model under a seed, the framework's sharder, and the
model-independent batch, loss and mask functions.

A *model spec* tells a driver (the harness, or ``tools/run_standalone.py``) how to build a real model, enter
context parallelism exactly as ``recipes/llm/train_ft.py`` does, and compute the loss; it holds no harness
internals and every function works on one rank, with or without ``torch.distributed``. A spec imports from here
what it does the common way and writes only what differs for its model and its CP path.

Interface (shapes: ``B`` batch rows, ``S`` global sequence in the caller's coordinates, ``S_local`` this
rank's shard, ``V`` vocabulary):

``NAME``, ``DTYPES``, ``BATCH_KEYS``
    Identifier, the dtypes the spec supports (``float32``, ``bfloat16``), the batch keys the model reads.
``build(dtype=torch.float32, seed=0, **overrides) -> model``
    The model in ``train()`` mode with seeded random weights; identical on every rank for the same arguments
    (``build_seeded``). ``overrides`` replace fields of the tiny config.
``shard(model, mesh, batch, padding_token_id=0) -> (ctx_factory, local_batch, sharder)``
    ``mesh`` a 1-D ``DeviceMesh`` named ``"cp"``, or ``None`` for one device; ``local_batch`` holds
    ``[B, S_local]`` tensors; enter ``ctx_factory()`` around the forward.
``forward(model, local_batch) -> logits [B, S_local, V]``; ``gather_logits(sharder, local_logits) -> [B, S, V]``
``local_labels(local_batch) -> [B, S_local]``; ``loss(logits, labels, num_label_tokens) -> scalar``
    The summed masked cross entropy over the *global* label count: the local losses summed over the CP group
    give the one-device loss, and so do the parameter gradients.
``num_label_tokens(batch) -> int``; ``valid_positions(batch) -> bool [B, S]``; ``make_batch(kind, seq_len, ...)``;
``pad_batch(batch, length)``; ``cp_padded_length(model, seq_len, cp_size)``.

Batch keys (``BATCH_KEYS``): ``input_ids [B, S] int64`` (required), ``labels [B, S] int64`` (required, already
shifted: ``labels[t]`` is the target of position ``t``, -100 where ignored, and for packed rows shifted within each
document with -100 on a document's last token), ``attention_mask [B, S]`` (optional, 1 real / 0 pad, right padding
only), ``position_ids [B, S]`` (optional), ``seq_lens [B, D] int64`` (packed rows: real document lengths, 0 or
-1000 for absent documents, concatenated from column 0, the rest of the row padding), ``seq_lens_padded [B, D]``
(optional physical span per document).

Device placement (the GPU-only specs): on a CUDA machine every rank of the harness's ``nccl`` pool has called
``torch.cuda.set_device(local_rank)`` (``cp_harness/ranks/worker.py``), so ``rank_device()`` is that rank's GPU;
elsewhere the CPU. Weights are drawn on the CPU under the seed (the same on every rank and device), then moved.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

# The interface's common half: a spec starts from ``from examples.automodel.models._base import *`` (these names)
# and then defines what differs for its model; the other helpers here it imports by name.
__all__ = [
    "DTYPES", "IGNORE_INDEX", "forward", "gather_logits", "local_labels", "loss", "make_batch", "num_label_tokens",
    "shard", "valid_positions",
]  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
IGNORE_INDEX = -100

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": {
        "input_ids": "[B, S] int64 token ids",
        "labels": "[B, S] int64 targets, already shifted (within each document when packed); -100 ignored",
    },
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding; right padding only (unpacked rows)",
        "position_ids": "[B, S] int64; unpacked rows must be 0..S-1 (the model checks)",
        "seq_lens": "[B, D] int64 real document lengths of a packed row (0 / -1000: absent)",
        "seq_lens_padded": "[B, D] int64 physical span per packed document (>= seq_lens)",
    },
    "produced_by_sharder": {
        "cp_group": "the CP process group (None on one device)",
        "packed_seq_ids": "[B, S_local] document ids, 0 = padding (packed rows)",
    },
}

_SHARDER = "nemo_automodel.components.distributed.context_parallel.sharder."
# ``COVERS`` entries that several specs' CP paths share word for word (their tables spread them in, in place).
COVERS_INDEX_MAP = {_SHARDER + "contiguous_local_indices": "this rank's global positions (the sharder's index map)"}
COVERS_GATHER_BY_INDICES = {
    _SHARDER
    + "gather_token_tensor_by_indices": "gather_logits: the logits back to global order (differentiable all-gather)"
}
COVERS_GATHER_TRIMMED = {
    _SHARDER + "ContextParallelSharder.gather_token_tensor": "logits back to global order (differentiable all_gather), "
    "CP padding trimmed"
}


# ---- building -----------------------------------------------------------------------------------------------
def dtype_name(spec: str, dtype: torch.dtype) -> str:
    """The config's name of ``dtype`` (``"float32"``, ``"bfloat16"``); ``ValueError`` naming ``spec`` otherwise."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{spec}: dtype {dtype} not supported (supported: {list(DTYPE_NAMES.values())})")
    return DTYPE_NAMES[dtype]


def tiny(fields: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A fresh copy of a spec's tiny config fields with ``overrides`` applied (the spec's table is never shared)."""
    return {**copy.deepcopy(fields), **overrides}


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block under ``torch.manual_seed(seed)`` and restore the caller's CPU RNG state afterwards."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def nonzero_parameters(model: torch.nn.Module) -> None:
    """Redraw every trainable parameter that is all zeros (attention sinks, router biases, gates) from N(0, 0.1^2).

    Zero-initialised parameters hide their effect and their gradient; frozen ones (``requires_grad=False``, e.g. a
    discrete indexer) are left as the framework made them.
    """
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad and not parameter.any():
                parameter.normal_(std=0.1)


def build_seeded(
    construct: Callable[[], Any], dtype: torch.dtype, seed: int, *, nonzero: bool = False
) -> torch.nn.Module:
    """``construct()`` then the framework's ``initialize_weights`` on the CPU in ``dtype``, all under ``seed``.

    Returns the model in ``train()`` mode, the same on every rank for the same arguments; with ``nonzero`` the
    all-zero trainable parameters are redrawn (``nonzero_parameters``). The caller's RNG state is restored.
    """
    with seeded(seed):
        model = construct()
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=dtype)
        if nonzero:
            nonzero_parameters(model)
    return model.train()


def padded_length(seq_len: int, cp_size: int, multiple: int) -> int:
    """``seq_len`` rounded up to a multiple of ``multiple`` at ``cp_size > 1`` (a spec's ``cp_padded_length``)."""
    return seq_len if cp_size <= 1 else seq_len + (-seq_len) % multiple


# ---- devices (the GPU-only specs) ------------------------------------------------------------------------------
def rank_device() -> torch.device:
    """This rank's device: ``cuda:<current device>`` where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter."""
    return next(model.parameters()).device


def batch_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A copy of ``batch`` whose tensors live on ``device``; always fresh tensors (``copy=True``).

    The recipe's batch comes fresh from the loader every step; torch ``context_parallel`` shards its buffers in
    place (``resize_``/``copy_``) and does not restore ``input_ids`` and ``labels``, so sharding the caller's own
    tensors would change the batch the one-device reference then reads.
    """
    return {
        key: (value.to(device, copy=True) if isinstance(value, torch.Tensor) else value) for key, value in batch.items()
    }


def unmet_requirements(requires: dict[str, str]) -> dict[str, str]:
    """The entries of a spec's ``REQUIRES`` that this process does not meet: ``"cuda"`` when
    ``torch.cuda.is_available()`` is false, a module name when it cannot be imported (``find_spec`` is None)."""
    unmet = {}
    for key, reason in requires.items():
        if key == "cuda":
            if not torch.cuda.is_available():
                unmet[key] = reason
        elif importlib.util.find_spec(key) is None:
            unmet[key] = reason
    return unmet


# ---- CP the framework's way ----------------------------------------------------------------------------------
def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """``ContextParallelSharder(model, mesh, batch)`` then ``shard``; ``mesh`` 1-D ``("cp",)`` or ``None`` (the
    identity sharder); ``batch`` not mutated. Returns ``(ctx_factory, local_batch, sharder)``, ``[B, S_local]``."""
    batch = dict(batch)
    sharder = ContextParallelSharder(model, mesh, batch, padding_token_id=padding_token_id)
    ctx_factory, local_batch = sharder.shard(batch)
    return ctx_factory, local_batch, sharder


def forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """Run the model on this rank's shard (inside ``ctx_factory()``): ``labels`` dropped, the keywords filtered by
    the framework's ``filter_forward_kwargs``; logits ``[B, S_local, V]``."""
    kwargs = {key: value for key, value in local_batch.items() if key != "labels"}
    return model(**filter_forward_kwargs(model, kwargs)).logits


def gather_logits(sharder: ContextParallelSharder, local_logits: torch.Tensor) -> torch.Tensor:
    """Local logits ``[B, S_local, V]`` -> ``[B, S, V]`` in global order and the caller's coordinates.

    The sharder's ``gather_token_tensor(trim=True, fill=0)`` where it can: in 0.7.0 its trim through a packed
    layout's position map (``input_token_stream_positions`` [B, S]) calls ``full.gather(1, positions)``, which
    accepts only [B, S] tensors and raises on [B, S, V] logits. There the spec gathers untrimmed with the same
    verb and applies the same map with the index expanded over the vocabulary.
    """
    layout = sharder.shard_layout
    positions = None if layout is None else layout.input_token_stream_positions
    if positions is None or local_logits.ndim == 2:
        return sharder.gather_token_tensor(local_logits, seq_dim=1, trim=True, fill=0)
    full = sharder.gather_token_tensor(local_logits, seq_dim=1, trim=False)
    positions = positions.to(full.device)
    index = positions.clamp(min=0).unsqueeze(-1).expand(-1, -1, full.shape[-1])
    return full.gather(1, index).masked_fill((positions < 0).unsqueeze(-1), 0)


def gather_trimmed(sharder: ContextParallelSharder, local_logits: torch.Tensor) -> torch.Tensor:
    """Local logits ``[B, S_local, V]`` -> ``[B, S, V]`` in global order, CP padding trimmed: the sharder's verb alone
    (the GPU-only specs' unpacked batches have no position map to apply)."""
    return sharder.gather_token_tensor(local_logits, seq_dim=1, trim=True)


# ---- batches, labels, loss -------------------------------------------------------------------------------------
def pad_batch(batch: dict[str, Any], length: int, pad_id: int = 0) -> dict[str, Any]:
    """An unpacked batch right-padded to ``length`` with masked pad tokens (``attention_mask`` 0, labels -100)."""
    if batch.get("seq_lens") is not None:
        raise ValueError("pad_batch pads unpacked rows only")
    extra = length - batch["input_ids"].shape[1]
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    pad = lambda t, v: torch.nn.functional.pad(t, (0, extra), value=v)  # noqa: E731
    return {
        "input_ids": pad(batch["input_ids"], pad_id),
        "labels": pad(batch["labels"], IGNORE_INDEX),
        "attention_mask": pad(mask, 0),
    }


def local_labels(local_batch: dict[str, Any]) -> torch.Tensor:
    """This rank's labels ``[B, S_local]`` as the sharder laid them out."""
    return local_batch["labels"]


def num_label_tokens(batch: dict[str, Any]) -> int:
    """Supervised targets in the global batch."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def loss(logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: int) -> torch.Tensor:
    """Summed masked cross entropy / the *global* label count; ``logits [B, s, V]``, ``labels [B, s]``."""
    return MaskedCrossEntropy(ignore_index=IGNORE_INDEX, reduction="sum")(
        logits, labels, num_label_tokens=num_label_tokens
    )


def valid_positions(batch: dict[str, Any]) -> torch.Tensor:
    """Bool ``[B, S]``: real tokens (not padding), the positions whose logits are compared."""
    input_ids = batch["input_ids"]
    if batch.get("seq_lens") is not None:
        lengths = batch["seq_lens"]
        spans = batch.get("seq_lens_padded", lengths)
        valid = torch.zeros_like(input_ids, dtype=torch.bool)
        for row in range(input_ids.shape[0]):
            start = 0
            for length, span in zip(lengths[row].tolist(), spans[row].tolist()):
                if length in (0, -1000):
                    continue
                valid[row, start : start + length] = True
                start += span
        return valid
    if batch.get("attention_mask") is not None:
        return batch["attention_mask"].bool()
    return torch.ones_like(input_ids, dtype=torch.bool)


def make_batch(
    kind: str,
    seq_len: int,
    *,
    batch_size: int = 1,
    seed: int = 0,
    vocab: int = 64,
    documents: list[list[int]] | None = None,
    pad: int = 0,
    pad_id: int = 0,
    pad_content: bool = False,
) -> dict[str, Any]:
    """An example batch with shifted labels.

    Args:
        kind: ``"plain"`` (every token real), ``"right_padded"`` (the last ``pad`` tokens of every row
            are padding, ``attention_mask`` 0, ``pad_id``), ``"left_padded"`` (the first ``pad`` tokens of every
            row are: what the framework's chat-template formatting emits with a left-padding tokenizer,
            ``format_chat_template`` with ``padding="max_length"``, whose loss mask it shifts for it,
            ``_maybe_shift_mask_for_left_padding``), or ``"packed"`` (``documents[row]`` lengths concatenated
            from column 0, the rest padding; ``seq_lens`` [B, D]).
        pad_content: ``pad_id`` as real content too (``plant_pad``: each document's last token, an EOS equal
            to the pad id, and its middle one), so that a mask derived from ``input_ids == pad_id`` is wrong.
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (batch_size, seq_len), generator=generator)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    if kind in ("plain", "right_padded"):
        real = seq_len - (pad if kind == "right_padded" else 0)
        if not 0 < real <= seq_len:
            raise ValueError(f"pad={pad} leaves no real token in {seq_len}")
        if pad_content:
            input_ids = plant_pad(input_ids, [[real]] * batch_size, pad_id)
        input_ids[:, real:] = pad_id
        labels[:, : real - 1] = input_ids[:, 1:real]
        batch = {"input_ids": input_ids, "labels": labels}
        if kind == "right_padded":
            mask = torch.zeros_like(input_ids)
            mask[:, :real] = 1
            batch["attention_mask"] = mask
        return batch
    if kind == "left_padded":
        real = seq_len - pad
        if not 0 < real < seq_len:
            raise ValueError(f"left_padded: pad={pad} must leave 1 to {seq_len - 1} real tokens of {seq_len}")
        if pad_content:
            input_ids[:, pad:] = plant_pad(input_ids[:, pad:], [[real]] * batch_size, pad_id)
        input_ids[:, :pad] = pad_id
        labels[:, pad : seq_len - 1] = input_ids[:, pad + 1 :]
        mask = torch.zeros_like(input_ids)
        mask[:, pad:] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}
    if kind == "packed":
        if documents is None or len(documents) != batch_size:
            raise ValueError("packed batches need one list of document lengths per row")
        if pad_content:
            input_ids = plant_pad(input_ids, documents, pad_id)
        width = max(len(row) for row in documents)
        seq_lens = torch.zeros(batch_size, width, dtype=torch.long)
        for row, lengths in enumerate(documents):
            if sum(lengths) > seq_len:
                raise ValueError(f"documents {lengths} exceed the row of {seq_len}")
            seq_lens[row, : len(lengths)] = torch.tensor(lengths)
            start = 0
            for length in lengths:
                labels[row, start : start + length - 1] = input_ids[row, start + 1 : start + length]
                start += length
            input_ids[row, start:] = pad_id
        return {"input_ids": input_ids, "labels": labels, "seq_lens": seq_lens}
    raise ValueError(f"unknown batch kind {kind!r}")


def plant_pad(tokens: torch.Tensor, documents: list[list[int]], pad_id: int = 0) -> torch.Tensor:
    """A copy of the drawn tokens ``[B, S]`` with ``pad_id`` as content: in row ``r``, each document of
    ``documents[r]`` (lengths from column 0) of 2 tokens or more ends with ``pad_id`` (an EOS equal to the
    tokenizer's pad id, as the recipe's ``padding_token_id``), and each of 3 or more has it in its middle too."""
    tokens = tokens.clone()
    for row, lengths in enumerate(documents):
        start = 0
        for length in lengths:
            if length >= 2:
                tokens[row, start + length - 1] = pad_id
            if length >= 3:
                tokens[row, start + length // 2] = pad_id
            start += length
    return tokens


def packed_kind(packed: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A spec's ``make_batch``: ``"plain"`` and ``"right_padded"`` as ``make_batch`` here; ``"packed"`` is
    ``packed(tokens, documents, pad_id, **options)`` on the same drawn tokens ``[B, S]`` (``documents[row]``: the
    lengths of row ``row``'s documents, concatenated from column 0, the rest of the row padding)."""

    def spec_make_batch(
        kind: str,
        seq_len: int,
        *,
        batch_size: int = 1,
        seed: int = 0,
        vocab: int = 64,
        documents: list[list[int]] | None = None,
        pad: int = 0,
        pad_id: int = 0,
        pad_content: bool = False,
        **options: Any,
    ) -> dict[str, Any]:
        if kind != "packed":
            return make_batch(
                kind,
                seq_len,
                batch_size=batch_size,
                seed=seed,
                vocab=vocab,
                pad=pad,
                pad_id=pad_id,
                pad_content=pad_content,
            )
        if documents is None or len(documents) != batch_size:
            raise ValueError("packed batches need one list of document lengths per row")
        tokens = torch.randint(1, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
        if pad_content:
            tokens = plant_pad(tokens, documents, pad_id)
        return packed(tokens, documents, pad_id, **options)

    spec_make_batch.__doc__ = f"An example batch with shifted labels; ``packed``: {packed.__doc__}"
    return spec_make_batch


def document_layout(tokens: torch.Tensor, lengths: list[int], pad_id: int = 0) -> tuple[torch.Tensor, ...]:
    """One packed row from its drawn tokens ``[S]``: documents of ``lengths`` from column 0, the rest ``pad_id``.

    Returns ``(input_ids, labels, doc_ids, positions)``, each ``[S]`` int64: labels shifted within each document
    (-100 on its last token and on padding), document index 1.. (0 padding), document-local positions (0 padding).
    """
    seq_len = tokens.shape[0]
    if sum(lengths) > seq_len or min(lengths, default=1) < 1:
        raise ValueError(f"documents {lengths} do not fit a row of {seq_len}")
    input_ids, labels = tokens.clone(), torch.full_like(tokens, IGNORE_INDEX)
    doc_ids, positions = torch.zeros_like(tokens), torch.zeros_like(tokens)
    start = 0
    for index, length in enumerate(lengths, start=1):
        labels[start : start + length - 1] = tokens[start + 1 : start + length]
        doc_ids[start : start + length] = index
        positions[start : start + length] = torch.arange(length)
        start += length
    input_ids[start:] = pad_id
    return input_ids, labels, doc_ids, positions


def thd_pack(tokens: torch.Tensor, lengths: list[int], pad_id: int = 0) -> dict[str, list[int]]:
    """One row as the THD packer's ``_pad_pack`` leaves it at ``cp_size`` 1 (the input of
    ``packed_sequence_thd_collater``): ``input_ids``, ``labels``, ``position_ids`` (document-local, then counting
    on through the trailing padding, clamped to ``S - 1``), ``seq_lens``, ``seq_lens_padded`` (the trailing padding
    added to the last document's span)."""
    input_ids, labels, _, positions = (t.tolist() for t in document_layout(tokens, lengths, pad_id))
    used, seq_len = sum(lengths), len(input_ids)
    positions[used:] = [min(positions[used - 1] + 1 + i, seq_len - 1) for i in range(seq_len - used)]
    spans = [*lengths[:-1], lengths[-1] + seq_len - used]
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "seq_lens": list(lengths),
            "seq_lens_padded": spans}  # fmt: skip
