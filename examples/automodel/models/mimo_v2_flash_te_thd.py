"""Model spec: nemo-automodel 0.7.0's ``MiMoV2FlashForCausalLM`` at a tiny random config, Transformer Engine
attention on packed THD batches: the framework's TE THD context parallelism (``cp_comm_type="a2a"``).

GPU only (``REQUIRES``): with ``backend.attn="te"`` every attention layer is a TE ``DotProductAttention`` (built at
construction), the THD partition is TE's ``thd_get_partitioned_indices`` (``transformer_engine_torch``), and TE's
fused attention runs on CUDA only. MiMo's CP refuses any other attention backend (``setup_cp_attention``:
"MiMo context parallelism requires backend.attn='te'"). Never run end to end (``docs/models/gpu_only.md``).

How the spec enters CP (as the recipe does):

1. the loader's THD packing (``packed_sequence_size > 0``, ``packing_strategy='thd'``): every document padded to a
   multiple of ``2 * cp_size`` (``packed_sequence.py``: ``cp_divisibility_factor``; 1 at ``cp_size`` 1),
   ``position_ids`` restarting per document, ``seq_lens`` / ``seq_lens_padded`` ``[B, D]`` (-1000 for absent
   documents), ``qkv_format="thd"``. The harness's batch (``make_batch``: plain, right padded or packed rows) is
   laid out this way by ``thd_batch`` for the CP size of the case; a plain row is one document, a right-padded
   row one document followed by pack padding.
2. per step: the batch on the rank's device, ``ContextParallelSharder(model, mesh, batch)``: the model's
   ``prepare_model_inputs_for_cp`` hook (``cp_size > 1``) returns ``make_mimo_te_cp_sharder``; at one device the
   dispatch takes the framework's TE THD sharder itself (the batch is THD and the model's attention is TE).
   ``sharder.shard(batch)``: ``shard_batch_for_mimo_te`` -> ``ensure_mimo_te_context_parallel`` (every
   ``self_attn.setup_cp_attention(cp_mesh, cp_stream)`` -> TE ``set_context_parallel_group(..., "a2a")``, once per
   CP group) -> ``make_cp_batch_for_te``: ``split_batch_into_thd_chunks`` (rows flattened to one token stream,
   ``cu_seqlens`` / ``cu_seqlens_padded``), ``thd_get_partitioned_indices`` (per document, chunks ``r`` and
   ``2N-1-r`` of ``2N``) and ``index_select`` of ``input_ids``, ``labels``, ``position_ids``, ``padding_mask``.
3. forward: TE attention with ``qkv_format="thd"``: the a2a transport exchanges heads for sequence (all-to-all
   before and after the attention kernel), so each rank attends over the whole stream for ``heads / cp`` heads.

Interface and shapes: as ``_base``, with:

``shard(...) -> (ctx_factory, local_batch, sharder)``
    ``local_batch`` is the THD shard: ``input_ids``, ``labels``, ``position_ids``, ``padding_mask`` ``[T_local]``,
    ``cu_seqlens`` ``[D + 1]`` (padded boundaries), ``max_seqlen``, ``qkv_format``, ``cp_size``, ``cp_rank``.
``forward(model, local_batch) -> logits [1, T_local, V]``
``local_labels(local_batch) -> [1, T_local]``
``gather_logits(sharder, local_logits) -> [B, S, V]``
    The sharder's ``gather_token_tensor(trim=True)`` (TE's partition, back to the laid-out rows ``[B, S_thd]``),
    then the layout's position map back to the harness's rows; positions with no token are 0.

Tiny config (``TINY``): hidden 64, 2 layers (layer 0 full attention, layer 1 sliding window 4 with an attention
sink, as MiMo-V2-Flash pairs them), 8 query and 8 key/value heads of 16 (a2a needs both head counts divisible
by ``cp_size``: ``WORLD_SIZES`` 1, 2, 4, 8), V head 16, partial RoPE, layer 1 MoE with 4 experts (2 active);
vocabulary 64. Backend ``BackendConfig(attn="te", linear="torch", rms_norm="torch_fp32", experts="torch",
dispatcher="torch", rope_fusion=False)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.mimo_v2_flash.config import MiMoV2FlashConfig
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

from . import _base
from ._base import *  # noqa: F403 - part of the spec interface
from ._base import IGNORE_INDEX, build_seeded, dtype_name, make_batch, model_device, num_label_tokens, rank_device, tiny

NAME = "mimo_v2_flash_te_thd"
FRAMEWORK_CLASS = "nemo_automodel.components.models.mimo_v2_flash.model.MiMoV2FlashForCausalLM"
WORLD_SIZES = (1, 2, 4, 8)  # TE's a2a CP: query and key/value head counts (8) divisible by cp_size
BATCH_KINDS = ("plain", "right_padded", "packed")
SEQ_LENS_PADDING = -1000  # the framework's sentinel for an absent document in seq_lens / seq_lens_padded

BUILD_ERROR_WITHOUT_TE = "ModuleNotFoundError: No module named 'transformer_engine'"
REQUIRES: dict[str, str] = {
    "transformer_engine": "backend.attn='te' builds a TE DotProductAttention per layer (MiMo CP accepts no other "
    "backend) and the THD partition is transformer_engine_torch.thd_get_partitioned_indices; "
    "without TE, build fails in nemo_automodel/components/attention/utils.py with: " + BUILD_ERROR_WITHOUT_TE,
    "cuda": "TE's fused attention and its THD context parallelism run on CUDA only; the one-device reference "
    "(TE attention on THD) needs CUDA too",
}
COVERS: dict[str, str] = {
    "nemo_automodel.components.models.mimo_v2_flash.model.MiMoV2FlashForCausalLM.prepare_model_inputs_for_cp": "requires attn='te' and qkv_format='thd', returns MiMo's TE THD sharder",
    "nemo_automodel.components.models.mimo_v2_flash.cp.shard_batch_for_mimo_te": "media masks, TE's local index map, then the framework's make_cp_batch_for_te",
    "nemo_automodel.components.models.mimo_v2_flash.parallelization.ensure_mimo_te_context_parallel": "by reading: setup_cp_attention on every self_attn, once per CP group (TE a2a)",
    "nemo_automodel.components.models.mimo_v2_flash.model.MiMoV2FlashAttention.setup_cp_attention": "by reading: head divisibility, TE set_context_parallel_group(cp_comm_type='a2a')",
    "nemo_automodel.components.distributed.context_parallel.utils.make_cp_batch_for_te": "split_batch_into_thd_chunks, then per-rank index_select of the token tensors",
    "nemo_automodel.components.distributed.thd_utils.split_batch_into_thd_chunks": "rows flattened to one THD stream, cu_seqlens / cu_seqlens_padded, padding_mask",
    "nemo_automodel.components.distributed.context_parallel.utils._shard_thd_chunk_for_te": "by reading: thd_get_partitioned_indices (per document, chunks r and 2N-1-r)",
    "nemo_automodel.components.models.mimo_v2_flash.model.MiMoV2FlashAttention._forward_te": "by reading: TE THD attention (a2a: all-to-all heads <-> sequence around the kernel)",
    "nemo_automodel.components.distributed.context_parallel.sharder.ContextParallelSharder.gather_token_tensor": "differentiable all_gather over TE's reported partition, unflattened to the laid-out rows",
}

BACKEND = dict(attn="te", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch", rope_fusion=False)

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=8, head_dim=16, v_head_dim=16, swa_num_attention_heads=8,
    swa_num_key_value_heads=8, swa_head_dim=16, swa_v_head_dim=16, hybrid_layer_pattern=[0, 1], moe_layer_freq=[0, 1],
    sliding_window=4, attention_chunk_size=None, partial_rotary_factor=0.5, add_full_attention_sink_bias=False,
    add_swa_attention_sink_bias=True, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=None,
    max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False, use_cache=False, pad_token_id=0,
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> MiMoV2FlashConfig:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    return MiMoV2FlashConfig(**tiny(TINY, overrides), torch_dtype=dtype_name(NAME, dtype))


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model with seeded random weights (drawn on the CPU), on ``rank_device()``, in train mode.

    Raises whatever the framework raises when TE attention cannot be built (no ``transformer_engine``).
    """
    from nemo_automodel.components.models.mimo_v2_flash.model import MiMoV2FlashForCausalLM

    cfg = config(dtype, **overrides)
    return build_seeded(lambda: MiMoV2FlashForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed).to(
        rank_device()
    )


def _documents(batch: dict[str, Any]) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, length)`` of every document of a harness batch (``make_batch``'s three kinds)."""
    input_ids = batch["input_ids"]
    rows, seq_len = input_ids.shape
    if batch.get("seq_lens") is not None:
        out = []
        for row in range(rows):
            start, docs = 0, []
            for length in batch["seq_lens"][row].tolist():
                if length in (0, SEQ_LENS_PADDING):
                    continue
                docs.append((start, length))
                start += length
            out.append(docs)
        return out
    mask = batch.get("attention_mask")
    lengths = [int(mask[row].sum()) if mask is not None else seq_len for row in range(rows)]
    return [[(0, length)] for length in lengths]


def thd_batch(batch: dict[str, Any], cp_size: int) -> tuple[dict[str, Any], torch.Tensor]:
    """The harness batch as the framework's THD packing lays it out for ``cp_size``.

    Every document is padded to a multiple of ``2 * cp_size`` (``cp_size`` 1: not padded), its ``position_ids``
    restart at 0 and run on through its padding, documents follow each other from column 0, and every row is
    padded to the longest. Returns the batch (``input_ids``, ``labels``, ``position_ids`` ``[B, S_thd]``,
    ``seq_lens``, ``seq_lens_padded`` ``[B, D]``, ``qkv_format="thd"``) and the position map ``[B, S]``: the
    column of each harness position in the laid-out row, -1 where the harness row holds padding.
    """
    factor = 2 * cp_size if cp_size > 1 else 1
    documents = _documents(batch)
    input_ids, labels = batch["input_ids"], batch["labels"]
    rows, seq_len = input_ids.shape
    spans = [[length + (-length) % factor for _, length in docs] for docs in documents]
    width = max(sum(row) for row in spans)
    width += (-width) % factor
    count = max(len(docs) for docs in documents)
    out_ids = torch.zeros(rows, width, dtype=input_ids.dtype)
    out_labels = torch.full((rows, width), IGNORE_INDEX, dtype=labels.dtype)
    out_positions = torch.zeros(rows, width, dtype=torch.long)
    seq_lens = torch.full((rows, count), SEQ_LENS_PADDING, dtype=torch.long)
    seq_lens_padded = torch.full((rows, count), SEQ_LENS_PADDING, dtype=torch.long)
    position_map = torch.full((rows, seq_len), -1, dtype=torch.long)
    for row, docs in enumerate(documents):
        column = 0
        for index, ((start, length), span) in enumerate(zip(docs, spans[row])):
            out_ids[row, column : column + length] = input_ids[row, start : start + length]
            out_labels[row, column : column + length] = labels[row, start : start + length]
            out_positions[row, column : column + span] = torch.arange(span)
            position_map[row, start : start + length] = torch.arange(column, column + length)
            seq_lens[row, index], seq_lens_padded[row, index] = length, span
            column += span
        if column < width:  # the row's trailing pack padding belongs to its last document's padded span
            seq_lens_padded[row, len(docs) - 1] += width - column
            start = int(out_positions[row, column - 1]) + 1
            out_positions[row, column:] = torch.arange(start, start + width - column)
    laid_out = {
        "input_ids": out_ids,
        "labels": out_labels,
        "position_ids": out_positions,
        "seq_lens": seq_lens,
        "seq_lens_padded": seq_lens_padded,
        "qkv_format": "thd",
    }
    return laid_out, position_map


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """The loader's THD layout for the mesh's CP size, on the model's device, then the recipe's sharder."""
    cp_size = mesh.size() if mesh is not None else 1
    laid_out, position_map = thd_batch(batch, cp_size)
    device = model_device(model)
    laid_out = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in laid_out.items()}
    sharder = ContextParallelSharder(model, mesh, laid_out, padding_token_id=padding_token_id)
    ctx_factory, local_batch = sharder.shard(laid_out)
    sharder._cp_harness_position_map = position_map  # read by gather_logits: laid-out rows -> harness rows
    return ctx_factory, local_batch, sharder


def forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """The model on this rank's THD shard; logits ``[1, T_local, V]``."""
    kwargs = {key: value for key, value in local_batch.items() if key != "labels"}
    logits = model(**filter_forward_kwargs(model, kwargs)).logits
    return logits if logits.ndim == 3 else logits.unsqueeze(0)


def local_labels(local_batch: dict[str, Any]) -> torch.Tensor:
    """This rank's THD labels as ``[1, T_local]`` (the logits' layout)."""
    labels = local_batch["labels"]
    return labels.reshape(1, -1)


def gather_logits(sharder: ContextParallelSharder, local_logits: torch.Tensor) -> torch.Tensor:
    """Local logits ``[1, T_local, V]`` -> ``[B, S, V]`` in the harness's rows (0 where the harness has padding)."""
    rows = sharder.gather_token_tensor(local_logits.squeeze(0), seq_dim=0, trim=True)  # [B, S_thd, V]
    position_map = sharder._cp_harness_position_map.to(rows.device)
    index = position_map.clamp(min=0).unsqueeze(-1).expand(-1, -1, rows.shape[-1])
    return rows.gather(1, index).masked_fill((position_map < 0).unsqueeze(-1), 0)


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """A one-document row of ``seq_len`` padded as the THD packing pads it at ``cp_size``."""
    return _base.padded_length(seq_len, cp_size, 2 * cp_size)


def _check_layout_arithmetic() -> None:  # used by tests/test_real_model_gpu_specs.py
    """``thd_batch`` keeps every harness token and label; raises AssertionError otherwise."""
    batch = make_batch("packed", 13, batch_size=2, seed=1, documents=[[5, 1, 4], [13]])
    for cp_size in (1, 2, 4):
        laid_out, position_map = thd_batch(batch, cp_size)
        assert laid_out["input_ids"].shape[1] % (2 * cp_size if cp_size > 1 else 1) == 0
        mapped = position_map >= 0
        for row in range(2):
            columns = position_map[row][mapped[row]]
            assert torch.equal(laid_out["input_ids"][row, columns], batch["input_ids"][row][mapped[row]])
            assert torch.equal(laid_out["labels"][row, columns], batch["labels"][row][mapped[row]])
        assert int((laid_out["labels"] != IGNORE_INDEX).sum()) == num_label_tokens(batch)
        assert all(math.isfinite(float(v)) for v in laid_out["seq_lens_padded"].flatten())
