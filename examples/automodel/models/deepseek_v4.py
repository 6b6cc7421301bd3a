"""Model spec: nemo-automodel 0.7.0's ``DeepseekV4ForCausalLM`` at a tiny random config (same interface as
``_base``: see that module's docstring; shard, forward, loss and unpacked batches are ``_base``'s;
packed batches and the one-device gather are this module's).

Tiny config: hidden 16, 4 layers with compress ratios ``[0, 4, 4, 0]`` (sliding window only, compressed with
the indexer, compressed, sliding window only), hash routing in layer 0, MoE 4 experts (2 active) + 1 shared,
2 heads of 8, vocabulary 64, window 4, no MTP or vision. Eager CPU backend as for V4.1.

How it enters CP (``recipes/llm/train_ft.py``): ``ContextParallelSharder(model, mesh, batch)`` calls the model's
``prepare_model_inputs_for_cp``, whose sharder is ``make_dsv4_contiguous_shard_cp_batch_and_ctx`` (pad multiple
``dsv4_cp_local_seq_multiple`` = 8 here); packed rows are first rebuilt by ``_repad_dsv4_packed_batch`` (every
document padded to that multiple, so each starts on a compressor window), then ``shard_batch_contiguous`` keeps one
contiguous slice per rank and the forward gets the CP group as ``_dsv4_cp_group``; attention, the compressor and
the indexer all-gather K/V, compressed keys and window metadata (``dsv4_cp_all_gather``, differentiable; its
backward returns each rank its slice of the summed gradient). No parallelizer step is needed: the router's aux
loss is off (``aux_loss_coeff=0``), so ``apply_cp``'s MoE mesh changes nothing. The recipe admits CP with packing
only with ``attn="tilelang"`` (a GPU kernel, never run here); the eager attention stands in for it on CPU with the
same masks and gathered tensors.

Packed batches (``make_batch("packed")``) are what the default THD packing feeds the model
(``packed_sequence_thd_collater``: ``qkv_format="thd"``, ``seq_lens``, ``seq_lens_padded``, document-local
``position_ids``); on one device the model builds its packed mask and document ids from ``seq_lens_padded`` only
when ``qkv_format == "thd"``, which ``_base.make_batch`` does not set (its one-device baseline attended
across documents).

Status (float32 and bfloat16, CP 2 and 3 against one rank, ``docs/models/deepseek_v4.md``): unpacked batches
(plain, odd length, right padded) and packed rows whose documents all start on a compressor window (a multiple of
4 here) or are too short to fill one match. Packed rows with a longer document that starts elsewhere do not: a
finding, not a CP error. One device pools windows of 4 *global* positions, so a window that straddles two
documents is dropped and a misaligned document's windows are shifted; CP repads every document to the window
(like every document alone), so one-device and CP training of the same packed data differ
(``repro/models/deepseek_v4_packed_windows.py``, exit 1 while it shows). Packing with
``packed_sequence.pad_to_multiple_of=4`` makes them agree.
"""

from __future__ import annotations

from typing import Any

import torch
from nemo_automodel.components.datasets.utils import pack_features_for_thd, packed_sequence_thd_collater
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from examples.automodel.models import _base
from examples.automodel.models._base import *  # noqa: F403  (the shared half of the interface)
from examples.automodel.models._base import IGNORE_INDEX, build_seeded, dtype_name, pad_batch, padded_length, tiny  # noqa: F401
from examples.automodel.models.deepseek_v41 import BACKEND

NAME = "deepseek_v4"
FRAMEWORK_CLASS = "nemo_automodel.components.models.deepseek_v4.model.DeepseekV4ForCausalLM"

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, qk_rope_head_dim=4, q_lora_rank=8, o_lora_rank=8, o_groups=2,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, compress_ratios=[0, 4, 4, 0], sliding_window=4,
    num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=4, index_head_dim=8, index_n_heads=2, index_topk=64,
    num_nextn_predict_layers=0, vision_n_layers=0, initializer_range=0.2, max_position_embeddings=4096,
    pad_token_id=0,
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> DeepseekV4Config:
    return DeepseekV4Config(**tiny(TINY, overrides), torch_dtype=dtype_name(NAME, dtype))


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    return build_seeded(
        lambda: DeepseekV4ForCausalLM(config(dtype, **overrides), backend=BackendConfig(**BACKEND)), dtype, seed
    )


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    from nemo_automodel.components.models.deepseek_v4.cp import dsv4_cp_local_seq_multiple  # noqa: PLC0415

    return padded_length(seq_len, cp_size, cp_size * max(dsv4_cp_local_seq_multiple(model.config), 2))


BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": _base.BATCH_KEYS["required"],
    "optional": {
        **_base.BATCH_KEYS["optional"],
        "position_ids": "[B, S] int64; unpacked rows 0..S-1; packed rows restart at 0 per document and count on "
        "through the trailing pack padding (the THD packer's layout)",
        "seq_lens_padded": "[B, D] int64 physical span per packed document; the last one includes the row's "
        "trailing padding (-1000: absent)",
        "qkv_format": '"thd" on packed batches (the THD collator\'s marker; the one-device path reads '
        "seq_lens_padded only when it is set)",
    },
    "produced_by_sharder": _base.BATCH_KEYS["produced_by_sharder"],
}

WORLD_SIZES: tuple[int, ...] = (1, 2, 3, 4)
BATCH_KINDS: tuple[str, ...] = ("plain", "right_padded", "packed")
# Framework CP callables this spec's CP path runs: each was seen running (a temporary counting wrapper around it
# during a CP step) at CP 2 in float32; "packed" / "unpacked" name the only batches that reach it.
COVERS: dict[str, str] = {
    "nemo_automodel.components.models.deepseek_v4.model.DeepseekV4ForCausalLM.prepare_model_inputs_for_cp": "the model's CP hook: its contiguous sharder with the compress-ratio pad multiple",
    "nemo_automodel.components.models.deepseek_v4.cp.make_dsv4_contiguous_shard_cp_batch_and_ctx": "the sharder: packed rows repadded, then contiguous slices, the CP group handed to the forward",
    "nemo_automodel.components.models.deepseek_v4.cp._repad_dsv4_packed_batch": "packed: every document padded to the per-rank multiple (window-aligned), the position map",
    "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_contiguous": "pads to CP x multiple and keeps one contiguous slice per rank",
    **_base.COVERS_INDEX_MAP,
    "nemo_automodel.components.models.deepseek_v4.cp.dsv4_cp_all_gather": "K/V, compressed keys and indexer keys all-gathered (differentiable)",
    "nemo_automodel.components.models.deepseek_v4.cp.dsv4_cp_all_gather_metadata": "positions, document ids, padding and window metadata all-gathered",
    "nemo_automodel.components.models.deepseek_v4.cp.build_dsv4_cp_packed_causal_padding_mask": "packed: local-query / global-key mask by document, position, padding and window",
    "nemo_automodel.components.models.deepseek_v4.cp.build_dsv4_cp_causal_padding_mask": "unpacked: local-query / global-key causal, padding and sliding-window mask",
    "nemo_automodel.components.models.deepseek_v4.layers._overlap_transform_with_cp": "the ratio-4 compressor's previous-window overlap across rank boundaries",
    **_base.COVERS_GATHER_BY_INDICES,
}


def gather_logits(sharder, local_logits: torch.Tensor) -> torch.Tensor:
    """Local logits ``[B, S_local, V]`` -> ``[B, S, V]`` in the caller's coordinates.

    One device on a packed (THD) batch: the model's own CP hook runs at CP 1 (``supports_thd``), leaves every tensor
    as given and reports no layout, so the logits are already in the caller's coordinates. Otherwise
    ``_base.gather_logits``.
    """
    mesh = getattr(sharder, "_cp_mesh", None)
    if sharder.shard_layout is None and (mesh is None or mesh.size() <= 1):
        return local_logits
    return _base.gather_logits(sharder, local_logits)


def _thd_packed(tokens: torch.Tensor, documents: list[list[int]], pad_id: int) -> dict[str, Any]:
    """What the framework's default THD packing feeds the model (``packed_sequence.packing_strategy:
    thd``, ``collate_fn: packed_sequence_thd_collater``, as in its DeepSeek V4 packed example config): each row's
    documents (``documents[row]`` lengths, labels shifted within each document, -100 on a document's last token)
    concatenated by ``pack_features_for_thd``, then padded to ``seq_len`` the way the THD packer pads a pack
    (``datasets/llm/packed_sequence.py _pad_pack``: pad tokens, labels -100, positions counting on from the last
    document's, the padding added to the last document's ``seq_lens_padded``), collated by
    ``packed_sequence_thd_collater``: ``input_ids``, ``labels``, ``position_ids`` ``[B, S]``, ``seq_lens``,
    ``seq_lens_padded`` ``[B, D]`` (-1000 where a row has fewer documents), ``qkv_format="thd"``.
    """
    records, seq_len = [], tokens.shape[1]
    for row, lengths in enumerate(documents):
        if sum(lengths) > seq_len or not lengths or min(lengths) < 1:
            raise ValueError(f"documents {lengths} do not fit a row of {seq_len}")
        features, start = [], 0
        for length in lengths:
            ids = tokens[row, start : start + length].tolist()
            features.append({"input_ids": ids, "labels": ids[1:] + [IGNORE_INDEX]})
            start += length
        record = pack_features_for_thd(features)
        extra = seq_len - len(record["input_ids"])
        if extra:  # the THD packer's trailing pack padding (_pad_pack)
            last = record["position_ids"][-1]
            record["input_ids"] += [pad_id] * extra
            record["labels"] += [IGNORE_INDEX] * extra
            record["position_ids"] += [min(last + 1 + i, seq_len - 1) for i in range(extra)]
            record["seq_lens_padded"][-1] += extra
        records.append(record)
    return packed_sequence_thd_collater(records)


make_batch = _base.packed_kind(_thd_packed)
