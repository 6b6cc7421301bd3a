"""Model spec: nemo-automodel 0.7.0's Kimi Linear (``KimiLinear48BForCausalLM``) at a tiny random config, MLA
layers only, CP the framework's way: contiguous shards and an all-gather of the compressed KV latent.

The interface is ``_base``'s (see its docstring for every function and shape); this module documents
what differs. Shapes: ``B`` rows, ``S`` global sequence, ``S_local`` this rank's shard, ``V`` vocabulary.

CP machinery (model-owned, ``_owns_cp_attention``): ``prepare_model_inputs_for_cp`` returns a
``ContextParallelSharder`` whose ``shard_batch`` (``kimi_linear.cp.shard_batch_for_kimi_cp``) resolves one
global document-id map ``[B, S]`` from the batch (``_packed_seq_ids``, else a 2-D ``attention_mask``, else
``seq_lens_padded`` / ``seq_lens``, else all ones minus ``padding_mask``), pads every stream to a multiple of
``cp``, keeps one contiguous slice per rank and hands the layers a ``KimiPackedContext`` (global map, shard
offset). Each MLA layer keeps its queries local, all-gathers the compressed latent
(``kv_a_proj_with_mqa`` output, ``kv_lora_rank + qk_rope_head_dim`` per token; ``all_gather_sequence``),
expands K/V from the full latent and runs FlexAttention with a causal per-document block mask of local
queries against global keys (``document_causal_flex_attention``). Backward (on CPU through the
``flex_backward_cpu`` stand-in): the all-gather's backward all-reduces the latent gradient and keeps this rank's slice.

Restricted to MLA: the real model interleaves Kimi Delta Attention (KDA) layers, whose one-device and CP paths
(``chunk_kda`` with FLA's ``cp_context``, short-convolution boundary exchange) are Triton kernels from
``fla`` (flash-linear-attention), not installed and not runnable on CPU (``KimiDeltaAttention.__init__``
raises ``UnavailableError`` without it). ``linear_attn_config["kda_layers"]`` is empty here, so KDA's CP path
is not judged.

How the spec enters CP: as a run with ``ep_size > 1`` does (the Kimi Linear CP recipe runs EP 8, CP 8): the
framework's ``apply_cp`` (``model_owned_cp.apply_moe_cp``) hands the mesh to every attention and MoE module,
then the recipe's ``ContextParallelSharder(model, mesh, batch)`` + ``shard(batch)``; on a CP twin of the model
(``model_owned_cp.cp_twin``). At ``ep_size == 1`` the infrastructure does not call ``apply_cp`` and the MLA
forward raises ``RuntimeError: Kimi MLA attention received a context-parallel batch but no CP mesh``; see
``docs/models/kimi_linear.md``.

One-device reference: the untouched model through the identity sharder (the batch as given). On CPU
the CP forward runs FlexAttention uncompiled, its backward through the ``flex_backward_cpu`` stand-in, (the framework's cache ``kimi_linear.cp._COMPILED_FLEX_ATTENTION``, set for the call and restored).

Batch keys: plain and right-padded batches are ``_base``'s. Packed rows (``documents`` per row,
concatenated from column 0), two forms, both from the framework's collaters:

* ``packing="neat"`` (default; the ``document_ids`` contract the model declares): ``neat_packed_collater``
  output, ``input_ids``, ``labels`` (shifted within each document), ``position_ids`` (document-local),
  ``attention_mask`` ``[B, S]`` (document index 1.., 0 padding), ``_packed_seq_ids`` (the same),
  ``packed_token_indices`` ``[B, S]``, ``cu_seqlens`` ``[B, D + 1]``, ``max_seqlen`` (int);
* ``packing="thd"`` (the recipe's default packing strategy, and the collater of the framework's Kimi Linear
  CP example): ``packed_sequence_thd_collater`` output, ``input_ids``, ``labels``, ``position_ids``,
  ``seq_lens`` / ``seq_lens_padded`` ``[B, D]`` (-1000 absent), ``qkv_format="thd"``. The one-device model
  ignores ``seq_lens`` (documents attend to each other) while CP honours them: finding K1 in
  ``docs/models/kimi_linear.md``; such cases fail.

Tiny config (``TINY``): hidden 16, 3 MLA layers (2 heads, nope 8 + rope 4 query/key dims, value 8, latent
``kv_lora_rank`` 8, no query LoRA, NoPE as the real model), layer 0 dense MLP, layers 1-2 MoE with 4 routed
experts (2 active, sigmoid router with score-correction bias) and one shared expert, vocabulary 64.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from nemo_automodel.components.datasets.utils import neat_packed_collater, packed_sequence_thd_collater
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.common.packing import PackingCapabilities
from nemo_automodel.components.models.kimi_linear import cp as kimi_cp
from nemo_automodel.components.models.kimi_linear import model as kimi_model
from nemo_automodel.components.models.kimi_linear.config import KimiLinear48BConfig
from nemo_automodel.components.models.kimi_linear.model import KimiLinear48BForCausalLM, KimiMLAAttention

from examples.automodel.models import _base, model_owned_cp
from examples.automodel.models._base import *  # noqa: F403  (re-exported: same verbs, same semantics)
from examples.automodel.models._base import pad_batch  # noqa: F401
from examples.automodel.models._kimi_mla import flex_attention_for, mla_cp_kernels, no_cpu_backward

NAME = "kimi_linear"
FRAMEWORK_CLASS = "nemo_automodel.components.models.kimi_linear.model.KimiLinear48BForCausalLM"
WORLD_SIZES = (1, 2, 3)  # CP 4 and above never run (3 ranks at most on the machine these were measured on)
BATCH_KINDS = ("plain", "right_padded", "packed")


STANDINS = ("flex_backward_cpu",)  # lifts the CPU refusal no_cpu_backward quotes; docs/standins.md
FORWARD_ONLY_ON: dict[str, str] = {}
FORWARD_ONLY_WITHOUT_STANDIN = {"cpu": no_cpu_backward(NAME)}  # tests' forward-only fixtures

COVERS: dict[str, str] = {
    "nemo_automodel.components.moe.parallelizer.apply_cp": "hands the CP mesh to every MLA module (setup_cp_attention) and MoE module",
    "nemo_automodel.components.models.kimi_linear.model.KimiMLAAttention.setup_cp_attention": "stores the CP mesh the latent all-gather uses",
    "nemo_automodel.components.models.kimi_linear.model.KimiLinear48BForCausalLM.prepare_model_inputs_for_cp": "returns the model-owned contiguous sharder",
    "nemo_automodel.components.models.kimi_linear.cp.shard_batch_for_kimi_cp": "global document map, pads to a multiple of cp, contiguous slices, KimiPackedContext",
    "nemo_automodel.components.models.kimi_linear.cp._global_doc_ids_from_batch": "document ids from _packed_seq_ids / attention_mask / seq_lens(_padded) / padding_mask",
    "nemo_automodel.components.models.kimi_linear.model.KimiMLAAttention._forward_with_cp": "local queries, gathered latent expanded to global K/V",
    "nemo_automodel.components.models.kimi_linear.cp.all_gather_sequence": "all-gathers the compressed latent along the sequence (autograd: all-reduce + slice)",
    "nemo_automodel.components.models.kimi_linear.cp.document_causal_flex_attention": "FlexAttention of local queries against global keys, causal per document",
    "nemo_automodel.components.models.kimi_linear.cp._document_causal_block_mask": "the block mask (global query offset = the shard start)",
    **_base.COVERS_GATHER_TRIMMED,
}

# fmt: off
BACKEND = dict(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
               fake_balanced_gate=False, enable_hf_state_dict_adapter=False)

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    mla_use_nope=True, num_experts=4, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=8,
    first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True, num_expert_group=1, topk_group=1,
    moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=2.446,
    linear_attn_config={"kda_layers": [], "full_attn_layers": [1, 2, 3], "short_conv_kernel_size": 4,
                        "head_dim": 8, "num_heads": 2},
    initializer_range=0.2, rms_norm_eps=1e-6, pad_token_id=0, use_cache=False,
)
# fmt: on

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": _base.BATCH_KEYS["required"],
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding, or document index 1.. / 0 (neat-packed rows)",
        "position_ids": "[B, S] int64 (document-local in packed rows; not read: NoPE)",
        "_packed_seq_ids": "[B, S] document index 1.. / 0 padding (neat-packed rows)",
        "packed_token_indices": "[B, S] row-local token positions, -1 padding (neat-packed rows)",
        "cu_seqlens": "[B, D + 1] int32 row-local boundaries, -1 after the last (neat-packed rows)",
        "max_seqlen": "int, longest document (neat-packed rows)",
        "seq_lens": "[B, D] int64 document lengths, -1000 absent (THD-packed rows)",
        "seq_lens_padded": "[B, D] int64 physical spans, trailing padding in the last (THD-packed rows)",
        "qkv_format": "'thd' (THD-packed rows)",
    },
    "produced_by_sharder": {
        "kimi_packed_context": "KimiPackedContext: global document ids [B, S_padded], shard start, cp size (CP)",
        "padding_mask": "[B, S_local] bool, True on padding (CP)",
    },
}


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> KimiLinear48BConfig:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    return KimiLinear48BConfig(**_base.tiny(TINY, overrides), torch_dtype=_base.dtype_name(NAME, dtype))


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model on CPU in ``train()`` mode with seeded random weights (same on every rank).

    Parameters are in ``dtype`` except the ones the framework keeps in float32 (router score-correction bias, made
    non-zero so that its effect on routing is exercised).
    """
    cfg = config(dtype, **overrides)
    return _base.build_seeded(
        lambda: KimiLinear48BForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed, nonzero=True
    )


shard = model_owned_cp.shard_on_twin  # the framework's apply_cp on the CP twin; local_batch holds kimi_packed_context


def forward(
    model: torch.nn.Module, local_batch: dict[str, Any], *, flex_cache: list = kimi_cp._COMPILED_FLEX_ATTENTION
) -> torch.Tensor:
    """``model_owned_cp.twin_forward`` with the uncompiled FlexAttention on CPU; logits ``[B, S_local, V]``."""
    with flex_attention_for(local_batch.get(model_owned_cp.TWIN_KEY, model), flex_cache):
        return model_owned_cp.twin_forward(model, local_batch)


CP_KERNELS = (
    "MLA attention by FlexAttention (kimi_linear/cp.py document_causal_flex_attention) instead of "
    "matmul + float32 softmax + matmul"
)


def cp_kernels(model: torch.nn.Module) -> contextlib.AbstractContextManager[str]:
    """Inside: the one-device forward of ``model`` computes MLA with the kernel the CP path uses (the
    framework's ``KimiMLAAttention._forward_with_cp`` over a world of one rank: FlexAttention under the
    one-device document map, no shard, no gather); its value names those kernels (``CP_KERNELS``). Exactly
    what changes: ``_kimi_mla.mla_cp_kernels``."""
    return mla_cp_kernels(model, KimiMLAAttention, kimi_model, kimi_cp.KimiPackedContext, CP_KERNELS)


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """Global length a row of ``seq_len`` is padded to at ``cp_size`` (a multiple of ``cp_size``)."""
    return _base.padded_length(seq_len, cp_size, cp_size)


_NEAT = PackingCapabilities(  # the contract the model declares (the same for Kimi K3)
    packed_mask_type=KimiLinear48BForCausalLM.packed_mask_type,
    requires_packed_sequence_metadata=KimiLinear48BForCausalLM.requires_packed_sequence_metadata,
)


def _packed(tokens: torch.Tensor, documents: list[list[int]], pad_id: int, packing: str = "neat") -> dict[str, Any]:
    """collated by the framework's ``neat_packed_collater`` (``packing="neat"``) or ``packed_sequence_thd_collater``
    (``packing="thd"``) from per-row packs laid out as its packers do (module docstring)."""
    if packing not in ("neat", "thd"):
        raise ValueError(f"packing must be 'neat' or 'thd', got {packing!r}")
    if packing == "thd":  # packed_sequence._pad_pack at cp_size 1: trailing padding joins the last span
        return packed_sequence_thd_collater([_base.thd_pack(tokens[row], d, pad_id) for row, d in enumerate(documents)])
    rows = []  # neat_packing._build_packed_sample: indexed mask, positions 0 on padding
    for row, lengths in enumerate(documents):
        input_ids, labels, doc_ids, positions = _base.document_layout(tokens[row], lengths, pad_id)
        rows.append({"input_ids": input_ids, "labels": labels, "attention_mask": doc_ids, "position_ids": positions})
    return neat_packed_collater(rows, packing=_NEAT)


make_batch = _base.packed_kind(_packed)
