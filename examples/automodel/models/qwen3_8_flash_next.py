"""Model spec: nemo-automodel 0.7.0's ``Qwen3_8_FlashNextForConditionalGeneration`` (language only) at a tiny
random config, CP the framework's way. Same interface as ``_base`` (see that module's docstring); the
shared halves (gather, loss, label count, valid positions, padding) are imported from it.

Shapes: ``B`` batch rows, ``S`` global sequence in the caller's coordinates, ``S_pad`` that padded to a
multiple of ``cp * max(indexer_compress_ratio, 2)``, ``S_local = S_pad / cp`` this rank's contiguous shard,
``V`` vocabulary.

How CP is entered (what ``recipes/llm/train_ft.py`` does):

* parallelisation: ``components/moe/parallelizer.py::apply_cp`` (run by ``parallelize_model`` at CP > 1) marks
  the model ``_cp_enabled``, sets ``model.cp_mesh``, hands the CP mesh to every ``self_attn.setup_cp_attention``
  (QSA stores ``_cp_mesh``) and every ``MoE.cp_mesh`` (with an auxiliary router loss, the router reduces its
  expert load over CP). The spec runs that function itself (``model_owned_cp.apply_moe_cp``: ``apply_cp``
  imports TransformerEngine's ``DotProductAttention`` only for an ``isinstance`` test; a placeholder stands in
  for the call where TE is absent) on a CP twin of the model (``model_owned_cp.cp_twin``: the same
  ``Parameter`` objects, its own modules), because ``apply_cp`` is permanent and a rank process of the harness
  also runs the one-device reference on the same model (with ``_cp_enabled`` set, the model refuses a batch
  without its CP context, as it should).
* every step: ``ContextParallelSharder(model, mesh, batch)``, which calls the model's
  ``prepare_model_inputs_for_cp`` hook (``cp.shard_batch_for_qwen3_8_flash_next_cp`` with
  ``pad_multiple=indexer_compress_ratio``, contiguous layout), then ``sharder.shard(batch)``. The local batch
  holds ``[B, S_local]`` ``input_ids``/``labels``/``position_ids``/``padding_mask`` and the replicated
  ``_qwen3_8_flash_next_cp_context`` (global raw ids ``[B, S_pad]`` for the PLE hash, global padding mask,
  local start, packed ``global_cu_seqlens``), and the twin under ``"_spec_cp_model"`` (``forward`` runs it). One
  device (``mesh=None``) runs the untouched model through the identity sharder: its own forward turns
  ``seq_lens`` into ``cu_seqlens``.

The CP machinery this exercises (``COVERS``): QSA main keys/values and the indexer's compressed keys gathered
in rank order (``qwen3_8_flash_next_cp_all_gather``; on packed rows the indexer gathers raw keys and rotary
values instead, ``_forward_packed_cp``); the PLE n-gram hash over the replicated ``global_input_ids`` then a
local slice (``Qwen3_8_FlashNextNGramEmbedding._forward_global_slice``); the PLE short convolution's left halo
(``qwen3_8_flash_next_cp_left_halo``: history ``(kernel - 1) * ngram_size = 9`` tokens, longer than a shard
here, so it reaches across several ranks, with rank 0's zero-width collective anchor).

Tiny config (``TINY``): hidden 16, 2 decoder layers, both ``full_attention`` (QSA; the GatedDeltaNet layers need
``fla`` kernels), PLE on layer 1 (``ple_layer_ids=[2]``, 16 hash heads of width 1, kernel 4, dilation 3), 2
HyperConnection streams, MoE 4 experts (2 active) + a gated shared expert, router auxiliary loss at the
released 1e-3 (its gradient, injected in the backward, is counted once by the harness's chunked reference), 2 query heads and 1 KV head of 8, QSA indexer 2 heads
of 8, ``indexer_compress_ratio=2``, ``indexer_budget=4`` (two blocks: positions >= 5 use the score top-k),
vocabulary 64, EOS id 2 (random tokens hit it: the hash resets its history after an EOS), pad id 0. Backend
``attn="flex"`` (the packed-CP backend the model declares; on CPU QSA runs the PyTorch oracle
``gathered_qsa_gqa_attention`` whatever the choice), ``linear="torch"``, ``rms_norm="torch_fp32"``,
``experts="torch"``, ``dispatcher="torch"``.

Departures from a released model, construction only: the PLE table is the framework's single-rank
reference table (``process_group=None``) on every rank, not the owner-sharded DTensor table (that needs the
FSDP parallelizer and an all-to-all over the FSDP mesh, which is not CP), and its 16 hash heads use small prime
moduli (``TABLE_PRIMES``, offsets their prefix sums: a 320M-row table does not fit), set on the persistent
hash buffers as a checkpoint of a smaller table would. All-zero trainable parameters (the PLE convolution,
the grouped norms' additive scales) are drawn non-zero so that their gradients, and the halo's, are judged.

Batches: ``"plain"``, ``"right_padded"`` as the default collater gives them; ``"packed"`` as the framework's
THD packer and ``packed_sequence_thd_collater`` give them at ``cp_size=1`` (what the recipe builds for a model
that owns its CP): ``input_ids``, ``labels``, document-relative ``position_ids``, ``seq_lens`` and
``seq_lens_padded`` (the last span includes the row's tail padding), ``qkv_format="thd"``. Packed rows: one per
micro-batch (the model rejects more, with or without CP).
"""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import torch
from nemo_automodel.components.datasets.utils import packed_sequence_thd_collater
from nemo_automodel.components.models.qwen3_8_flash_next import model as _qwen_model
from nemo_automodel.components.models.qwen3_8_flash_next.backend import Qwen3_8_FlashNextBackendConfig
from nemo_automodel.components.models.qwen3_8_flash_next.config import Qwen3_8_FlashNextConfig
from nemo_automodel.components.models.qwen3_8_flash_next.engram import Qwen3_8_FlashNextEngramTableConfig

from examples.automodel.models import _base, model_owned_cp
from examples.automodel.models._base import *  # noqa: F403  (the shared half of the interface)
from examples.automodel.models._base import build_seeded, dtype_name, pad_batch, tiny  # noqa: F401

NAME = "qwen3_8_flash_next"
FRAMEWORK_CLASS = "nemo_automodel.components.models.qwen3_8_flash_next.model.Qwen3_8_FlashNextForConditionalGeneration"
WORLD_SIZES = (1, 2, 3, 4)
BATCH_KINDS = ("plain", "right_padded", "packed")
BATCH_ROWS = {"packed": (1,)}  # the model packs one physical row per micro-batch (THD), with or without CP

_CP = "nemo_automodel.components.models.qwen3_8_flash_next.cp."
COVERS: dict[str, str] = {
    _CP
    + "shard_batch_for_qwen3_8_flash_next_cp": "the model-owned sharder: right-tail validation, seq_lens -> cu_seqlens, pad to cp*max(ratio,2), "
    "contiguous slice, the replicated CP context",
    _CP
    + "qwen3_8_flash_next_cp_all_gather": "QSA main keys/values (differentiable), the indexer's compressed keys (unpacked rows) and its raw "
    "keys and rotary values (packed rows), all in rank order",
    _CP
    + "qwen3_8_flash_next_cp_left_halo": "the PLE short convolution's 9-token causal history from the preceding ranks; rank 0's anchor",
    "nemo_automodel.components.models.qwen3_8_flash_next.engram.Qwen3_8_FlashNextNGramEmbedding._forward_global_slice": "PLE n-gram hash over the replicated global_input_ids (EOS and packed-segment resets), local slice",
    "nemo_automodel.components.models.qwen3_8_flash_next.qsa.Qwen3_8_FlashNextQSAIndexer._forward_packed_cp": "packed rows: per-document block scoring of the local queries against the gathered keys",
}
# With the router's auxiliary loss on (the released 1e-3, the default here) the CP path also runs
# nemo_automodel.components.moe.layers.Gate._compute_aux_loss with the expert load, scores and token count
# reduced over the CP mesh.

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": {
        "input_ids": "[B, S] int64 raw token ids (the PLE hash reads them)",
        "labels": "[B, S] int64 targets, already shifted (within each document when packed); -100 ignored",
    },
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding; right-tail padding only (unpacked rows)",
        "position_ids": "[B, S] int64; packed rows: document-relative, as the THD packer writes them",
        "seq_lens": "[1, D] int64 real document lengths of the packed row (-1000: absent)",
        "seq_lens_padded": "[1, D] int64 physical spans (the loader's; the model reads seq_lens)",
        "qkv_format": "'thd' on packed batches (the THD collater's marker)",
    },
    "produced_by_sharder": {
        "padding_mask": "[B, S_local] bool, True on padding (right tail and CP padding)",
        "_qwen3_8_flash_next_cp_context": "replicated global raw ids / padding mask [B, S_pad], local start, "
        "packed global cu_seqlens (CP only)",
    },
}

# fmt: off
BACKEND = dict(attn="flex", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
               enable_hf_state_dict_adapter=False)

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
    layer_types=["full_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    # Rotary width 4 of the head's 8; text positions repeat on the 3 mRoPE axes, so their sections do not matter.
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
    router_aux_loss_coef=1e-3,  # the released value: the CP path reduces the router's expert load over CP
    hc_count=2, hc_lowrank=4, ple_layer_ids=[2], ple_embed_dim=16, ple_conv_kernel_size=4, ngram_size=3,
    heads_per_ngram=8, indexer_budget=4, indexer_compress_ratio=2, indexer_head_dim=8, indexer_kv_heads=1,
    indexer_n_heads=2, initializer_range=0.2, rms_norm_eps=1e-6, max_position_embeddings=4096, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)
# fmt: on
# Moduli of the 16 PLE hash heads (the released ones are ~2e7 each: a 320M-row table).
TABLE_PRIMES = (17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79)


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Qwen3_8_FlashNextConfig:
    """The framework's config for the tiny language-only model (``TINY`` with ``overrides``) in ``dtype``."""
    text = {**tiny(TINY, overrides), "dtype": dtype_name(NAME, dtype)}
    return Qwen3_8_FlashNextConfig(text_config=text, vision_config={"depth": 1}, language_model_only=True)


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build the tiny model with seeded random weights (same on every rank for the same arguments).

    Returns:
        ``Qwen3_8_FlashNextForConditionalGeneration`` on CPU in train mode, parameters in ``dtype``; the QSA
        indexer is frozen by the framework (``requires_grad=False``: its routes are discrete).
    """
    cfg = config(dtype, **overrides)
    text = cfg.text_config
    heads = (text.ngram_size - 1) * text.heads_per_ngram
    if len(TABLE_PRIMES) != heads:
        raise ValueError(f"{NAME}: {heads} PLE hash heads need {heads} moduli, TABLE_PRIMES has {len(TABLE_PRIMES)}")
    table = Qwen3_8_FlashNextEngramTableConfig(
        num_embeddings=sum(TABLE_PRIMES),
        embedding_dim=text.ple_embed_dim // heads,
        initializer_range=text.initializer_range,
    )

    def construct() -> torch.nn.Module:
        # Under torch.distributed the constructor would owner-shard the table over WORLD; None builds the
        # framework's single-rank reference table (the owner sharding is FSDP's business, not CP's).
        with mock.patch.object(_qwen_model, "_default_owner_group", lambda: None):
            model = _qwen_model.Qwen3_8_FlashNextForConditionalGeneration(
                cfg, backend=Qwen3_8_FlashNextBackendConfig(**BACKEND), engram_table_config=table
            )
        offsets = [0, *itertools.accumulate(TABLE_PRIMES)][:-1]
        for layer in model.model.language_model.layers.values():
            if layer.ple is not None:
                hashing = layer.ple.ple_embedding
                hashing.ngram_heads_vocab_sizes.copy_(torch.tensor(TABLE_PRIMES))
                hashing.ngram_heads_offsets.copy_(torch.tensor(offsets))
        return model

    return build_seeded(construct, dtype, seed, nonzero=True)


# The recipe's step (``ContextParallelSharder`` then ``shard``) on the model's CP twin (the framework's ``apply_cp``
# applied) when the mesh has more than one rank; ``ctx_factory`` is the sharder's (a null context).
shard = model_owned_cp.shard_on_twin
forward = model_owned_cp.twin_forward


def cp_padded_length(model: Any, seq_len: int, cp_size: int) -> int:
    """Global length an unpacked row of ``seq_len`` is padded to at ``cp_size``: ``cp * max(ratio, 2)``."""
    return _base.padded_length(seq_len, cp_size, cp_size * max(int(model.config.text_config.indexer_compress_ratio), 2))


def _thd_packed(tokens: torch.Tensor, documents: list[list[int]], pad_id: int) -> dict[str, Any]:
    """rows packed as ``packed_sequence._pad_pack`` (cp_size 1) lays them out (the THD collater's ``position_ids``,
    ``seq_lens``, ``seq_lens_padded``, ``qkv_format``), collated by the framework's ``packed_sequence_thd_collater``."""
    return packed_sequence_thd_collater([_base.thd_pack(tokens[row], d, pad_id) for row, d in enumerate(documents)])


make_batch = _base.packed_kind(_thd_packed)
