"""Model spec: nemo-automodel 0.7.0's ``DeepseekV41ForCausalLM`` at a tiny random config, CP the framework's way.

A *model spec* tells a driver (the harness, or ``tools/run_standalone.py``) how to build a real model, enter
context parallelism exactly as ``recipes/llm/train_ft.py`` does, and compute the loss. It holds no harness
internals; every function works on one rank, with or without ``torch.distributed``.

Interface (shapes: ``B`` batch rows, ``S`` global sequence in the caller's coordinates, ``S_local`` this
rank's shard, ``V`` vocabulary):

``NAME``, ``DTYPES``
    Identifier and the dtypes the spec supports (``torch.float32``, ``torch.bfloat16``; float64 does not
    run: the eager attention computes in float32 and casts back).
``BATCH_KEYS``
    The batch keys the model reads, what they hold, and which are required (see below).
``build(dtype=torch.float32, seed=0, **overrides) -> model``
    The model on CPU in ``train()`` mode with seeded random weights; identical on every rank for the
    same arguments. Expensive (about 0.3 s): a driver builds it once per (dtype, overrides) and caches
    it. ``overrides`` replace fields of the text config (e.g. ``index_topk=3, candidate_topk_blocks=2``).
``shard(model, mesh, batch, padding_token_id=0) -> (ctx_factory, local_batch, sharder)``
    ``ContextParallelSharder(model, mesh, batch)`` then ``sharder.shard(batch)``. ``mesh`` is a 1-D
    ``DeviceMesh`` with dimension name ``"cp"``, or ``None`` for one device (identity sharder). ``batch``
    is not mutated (a shallow copy is sharded). ``local_batch`` holds ``[B, S_local]`` tensors (labels
    included) plus model metadata (``cp_group``, ``packed_seq_ids``); enter ``ctx_factory()`` around the
    forward.
``forward(model, local_batch) -> logits [B, S_local, V]``
    Drops ``labels``, filters the keywords with the framework's ``filter_forward_kwargs`` and calls the
    model. float32 logits (the LM head is kept in float32).
``gather_logits(sharder, local_logits) -> logits [B, S, V]``
    The sharder's differentiable ``gather_token_tensor(trim=True, fill=0)``: global order, CP padding
    trimmed, packed alignment undone (caller's coordinates; positions the model dropped are 0).
``local_labels(local_batch) -> [B, S_local]``
    The labels the sharder produced for this rank (-100 on CP and alignment padding).
``loss(logits, labels, num_label_tokens) -> scalar``
    ``MaskedCrossEntropy(reduction="sum")`` divided by the *global* label count. Works on local
    (``logits [B, S_local, V]`` with ``local_labels``) or global tensors; summing the local losses over
    the CP group gives the one-device loss, and so do the parameter gradients summed over the group.
``num_label_tokens(batch) -> int``
    Supervised targets in the global batch (``labels != -100``).
``valid_positions(batch) -> bool [B, S]``
    Positions whose logits are defined (real tokens; padding excluded) and compared.
``make_batch(kind, seq_len, *, batch_size=1, seed=0, vocab=64, documents=None, pad=0) -> batch``
    Example batches: ``"plain"``, ``"right_padded"`` (``pad`` trailing pad tokens), ``"packed"``
    (``documents``: list of lengths per row).

Batch keys (``BATCH_KEYS``): ``input_ids [B, S] int64`` (required), ``labels [B, S] int64`` (required,
already shifted: ``labels[t]`` is the target of position ``t``, -100 where ignored, and for packed rows
shifted within each document with -100 on a document's last token), ``attention_mask [B, S]`` (optional,
1 real / 0 pad, right padding only), ``position_ids [B, S]`` (optional; unpacked rows must hold
``0..S-1``), ``seq_lens [B, D] int64`` (packed rows: real document lengths, 0 or -1000 for absent
documents; documents are concatenated from column 0 and the rest of the row is padding),
``seq_lens_padded [B, D]`` (optional physical span per document). Packed rows need no ``attention_mask``
or ``position_ids``: the model derives document ids and document-local positions from ``seq_lens``.
Left padding is not supported by the model.

Tiny config (``TINY``): hidden 16, 6 layers with compress ratios ``[0, 2, 2, 1, 1, 1]``: layer 0
sliding-window only, 1 Full (ratio 2, KV and index source), 2 Reuse (ratio 2), 3 Full (ratio 1, KV,
index and candidate-block source), 4 Reindex (ratio 1, uses candidates), 5 Reuse (ratio 1); MoE with 4
routed experts (2 active) and one shared expert per layer; 2 heads of 8; vocabulary 64; window 4; no
Engram, vision or MTP. Backend ``BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32",
experts="torch", dispatcher="torch")``. The default ``index_topk``/``candidate_topk_blocks`` are larger
than any compressed width used here, so the indexer keeps every visible key; smaller values exercise
the hard top-k selection, whose ties (``relu`` zeros) make the result depend on the row width, hence on
CP padding (see ``padding_sensitivity_repro`` in ``tools/run_standalone.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

NAME = "deepseek_v41"
FRAMEWORK_CLASS = "nemo_automodel.components.models.deepseek_v41.model.DeepseekV41ForCausalLM"
DTYPES = (torch.float32, torch.bfloat16)
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

BACKEND = dict(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")

TINY: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=16,
    moe_intermediate_size=8,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    qk_rope_head_dim=4,
    q_lora_rank=8,
    o_lora_rank=8,
    o_groups=2,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    sliding_window=4,
    compress_ratios=[0, 2, 2, 1, 1, 1],
    kv_source_layer_ids=[1, 3],
    index_source_layer_ids=[1, 3, 4],
    index_n_heads=2,
    index_head_dim=8,
    index_topk=64,
    candidate_source_layer_id=3,
    candidate_topk_blocks=64,
    candidate_block_size=2,
    hc_mult=2,
    hc_sinkhorn_iters=4,
    rms_norm_eps=1e-6,
    engram_layer_ids=[],
    engram_num_embeddings=[],
    num_nextn_predict_layers=0,
    dspark_target_layer_ids=[],
    initializer_range=0.2,
    max_position_embeddings=4096,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 256},
    dspark_noise_token_id=63,
    pad_token_id=0,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> DeepseekV41Config:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"{NAME}: dtype {dtype} not supported (supported: {list(_DTYPE_NAMES.values())})")
    text = {**copy.deepcopy(TINY), **overrides, "dtype": _DTYPE_NAMES[dtype]}
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0},
                             dtype=_DTYPE_NAMES[dtype], pad_token_id=text["pad_token_id"])


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build the tiny model with seeded random weights (same on every rank for the same arguments).

    Returns:
        ``DeepseekV41ForCausalLM`` on CPU in train mode. Parameters are in ``dtype`` except the ones the
        framework keeps in float32 (LM head, hyper-connections, sinks, compressor, router bias).
    """
    cfg = config(dtype, **overrides)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DeepseekV41ForCausalLM(cfg, backend=BackendConfig(**BACKEND))
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=dtype)
        # Non-zero attention sinks and router bias, so their gradients and effects are exercised.
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.requires_grad and not parameter.any():
                    parameter.normal_(std=0.1)
    finally:
        torch.random.set_rng_state(state)
    return model.train()


def shard(model: torch.nn.Module, mesh: Any, batch: dict[str, Any], padding_token_id: int = 0,
          ) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """Enter CP the framework's way: ``ContextParallelSharder(model, mesh, batch)`` then ``shard``.

    Args:
        model: From ``build``.
        mesh: 1-D ``DeviceMesh`` named ``("cp",)`` or ``None`` (one device: the identity sharder, and the
            model's own forward handles packing).
        batch: Global batch, keys as in ``BATCH_KEYS``; not mutated.
    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch`` tensors are ``[B, S_local]``.
    """
    batch = dict(batch)
    sharder = ContextParallelSharder(model, mesh, batch, padding_token_id=padding_token_id)
    ctx_factory, local_batch = sharder.shard(batch)
    return ctx_factory, local_batch, sharder


def forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """Run the model on this rank's shard (call inside ``ctx_factory()``); logits ``[B, S_local, V]``."""
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


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """Global length an unpacked row of ``seq_len`` is padded to at ``cp_size`` (``cp_size * max(lcm(ratios), 2)``).

    Running one device on a row right-padded (masked) to this length reproduces what CP padding does to the
    model, which separates padding sensitivity from CP errors.
    """
    if cp_size <= 1:
        return seq_len
    divisor = cp_size * max(model._packed_alignment, 2)
    return seq_len + (-seq_len) % divisor


def pad_batch(batch: dict[str, Any], length: int, pad_id: int = 0) -> dict[str, Any]:
    """An unpacked batch right-padded to ``length`` with masked pad tokens (``attention_mask`` 0, labels -100)."""
    if batch.get("seq_lens") is not None:
        raise ValueError("pad_batch pads unpacked rows only")
    extra = length - batch["input_ids"].shape[1]
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    pad = lambda t, v: torch.nn.functional.pad(t, (0, extra), value=v)  # noqa: E731
    return {"input_ids": pad(batch["input_ids"], pad_id), "labels": pad(batch["labels"], IGNORE_INDEX),
            "attention_mask": pad(mask, 0)}


def local_labels(local_batch: dict[str, Any]) -> torch.Tensor:
    """This rank's labels ``[B, S_local]`` as the sharder laid them out."""
    return local_batch["labels"]


def num_label_tokens(batch: dict[str, Any]) -> int:
    """Supervised targets in the global batch."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def loss(logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: int) -> torch.Tensor:
    """Summed masked cross entropy / the *global* label count; ``logits [B, s, V]``, ``labels [B, s]``."""
    return MaskedCrossEntropy(ignore_index=IGNORE_INDEX, reduction="sum")(
        logits, labels, num_label_tokens=num_label_tokens)


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
                valid[row, start:start + length] = True
                start += span
        return valid
    if batch.get("attention_mask") is not None:
        return batch["attention_mask"].bool()
    return torch.ones_like(input_ids, dtype=torch.bool)


def make_batch(kind: str, seq_len: int, *, batch_size: int = 1, seed: int = 0, vocab: int = 64,
               documents: list[list[int]] | None = None, pad: int = 0, pad_id: int = 0) -> dict[str, Any]:
    """An example batch with shifted labels.

    Args:
        kind: ``"plain"`` (every token real), ``"right_padded"`` (the last ``pad`` tokens of every row
            are padding, ``attention_mask`` 0, ``pad_id``), or ``"packed"`` (``documents[row]`` lengths
            concatenated from column 0, the rest padding; ``seq_lens`` [B, D]).
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (batch_size, seq_len), generator=generator)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    if kind in ("plain", "right_padded"):
        real = seq_len - (pad if kind == "right_padded" else 0)
        if not 0 < real <= seq_len:
            raise ValueError(f"pad={pad} leaves no real token in {seq_len}")
        input_ids[:, real:] = pad_id
        labels[:, :real - 1] = input_ids[:, 1:real]
        batch = {"input_ids": input_ids, "labels": labels}
        if kind == "right_padded":
            mask = torch.zeros_like(input_ids)
            mask[:, :real] = 1
            batch["attention_mask"] = mask
        return batch
    if kind == "packed":
        if documents is None or len(documents) != batch_size:
            raise ValueError("packed batches need one list of document lengths per row")
        width = max(len(row) for row in documents)
        seq_lens = torch.zeros(batch_size, width, dtype=torch.long)
        for row, lengths in enumerate(documents):
            if sum(lengths) > seq_len:
                raise ValueError(f"documents {lengths} exceed the row of {seq_len}")
            seq_lens[row, :len(lengths)] = torch.tensor(lengths)
            start = 0
            for length in lengths:
                labels[row, start:start + length - 1] = input_ids[row, start + 1:start + length]
                start += length
            input_ids[row, start:] = pad_id
        return {"input_ids": input_ids, "labels": labels, "seq_lens": seq_lens}
    raise ValueError(f"unknown batch kind {kind!r}")
