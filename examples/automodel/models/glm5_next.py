"""Model spec: nemo-automodel 0.7.0's ``Glm5NextForConditionalGeneration`` (GLM-5.3, text only) at a tiny random
config, CP the framework's way. Same interface as ``_base`` (see that module's docstring); the gather, loss,
label count, valid positions and padding are imported from it, and ``shard``/``forward`` (the framework's
``apply_cp`` on a CP twin, then the recipe's sharder) and ``make_batch`` (the framework's own batch layouts)
from ``qwen3_8_flash_next``.

Shapes: ``B`` batch rows, ``S`` global sequence in the caller's coordinates, ``S_pad`` that padded to a
multiple of the CP size, ``S_local = S_pad / cp`` this rank's contiguous shard, ``V`` vocabulary.

How CP is entered (what ``recipes/llm/train_ft.py`` does):

* parallelisation: ``components/moe/parallelizer.py::apply_cp`` hands the CP mesh to every decoder block's
  ``self_attn.setup_cp_attention`` (DSA keeps ``_cp_mesh`` for its hidden-state gather), to every ``MoE`` and
  marks the model ``_cp_enabled``. The spec runs that function (``model_owned_cp.apply_moe_cp``: a placeholder
  for the TransformerEngine class it imports only for an ``isinstance`` test) on a CP twin of the model
  (``model_owned_cp.cp_twin``: same parameters, own modules); the one-device reference runs the untouched model.
* every step: ``ContextParallelSharder(model, mesh, batch)`` calls the model's ``prepare_model_inputs_for_cp``
  (``cp.shard_batch_for_glm5_next_cp`` with ``shard_primary=False``): labels, positions and ``padding_mask``
  are padded to a multiple of the CP size and sliced contiguously; ``input_ids`` stay global (the forward
  embeds the whole row, pads it and slices this rank's part); the document map goes into a replicated
  ``glm5_next_packed_context`` (``doc_ids [B, S_pad]``, 0 = padding, from ``seq_lens_padded`` /
  ``seq_lens`` / ``attention_mask``). One device (``mesh=None``) gets the identity sharder: the forward builds
  its document map from ``_packed_seq_ids`` / ``cu_seqlens`` / ``attention_mask`` / ``padding_mask``.

The CP machinery this exercises (``COVERS``): DSA gathers the *hidden states* of the whole row
(``cp.all_gather_sequence``: all-gather forward, all-reduce + local slice backward), then for every document
that has queries on this rank recomputes the document's latent keys/values and KPool index pools from the
gathered states and attends its local queries (``Glm5NextSparseAttention._forward_document``, SDPA with the
indexer's boolean mask); ``cp.all_gather_backward_anchor`` keeps ranks whose interval holds no query of any
document (padding only) in the backward all-reduce.

Tiny config (``TINY``): hidden 16, 2 decoder layers, both ``deepseek_sparse_attention`` (the KDA layers need
``fla``: ``build_fla_cp_context`` raises without it), layer 0 a dense SwiGLU MLP and layer 1 MoE (4 routed
experts, 2 active, sigmoid scores with the correction bias, one shared expert), 2 heads with q/kv LoRA rank 8,
NoPE head 8, value head 8, indexer 2 heads of 8 with KPool 2 and ``index_topk=4`` (two pools + the causal
tail; from position 5 on the top-k chooses), 2 mHC streams, 4 Sinkhorn iterations, vocabulary 64, pad id 0.
The vision tower is built (1 tiny block) but no batch carries pixels: its gradients are zero on both sides.
Backend ``attn="sdpa"`` (a packed-CP backend the model declares), ``linear="torch"``, ``rms_norm="torch_fp32"``,
``experts="torch"``, ``dispatcher="torch"``. All-zero trainable parameters (mHC ``base``, the KPool APE) are
drawn non-zero.

Batches: as ``qwen3_8_flash_next.make_batch`` (plain, right padded, the framework's THD packed layout). Packed
rows: several per batch are accepted (one document map per row).
"""

from __future__ import annotations

from typing import Any

import torch
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.glm5_next.config import Glm5NextConfig
from nemo_automodel.components.models.glm5_next.model import Glm5NextForConditionalGeneration

from examples.automodel.models._base import *  # noqa: F403  (the shared half of the interface)
from examples.automodel.models._base import build_seeded, dtype_name, pad_batch, padded_length, tiny  # noqa: F401
from examples.automodel.models.qwen3_8_flash_next import forward, make_batch, shard  # noqa: F401

NAME = "glm5_next"
FRAMEWORK_CLASS = "nemo_automodel.components.models.glm5_next.model.Glm5NextForConditionalGeneration"
WORLD_SIZES = (1, 2, 3, 4)
BATCH_KINDS = ("plain", "right_padded", "packed")

_CP = "nemo_automodel.components.models.glm5_next.cp."
_LAYERS = "nemo_automodel.components.models.glm5_next.layers."
COVERS: dict[str, str] = {
    _CP
    + "shard_batch_for_glm5_next_cp": "the model-owned aux-only sharder: document map, pad to a multiple of cp, contiguous labels/positions/"
    "padding_mask, input_ids left global",
    _CP
    + "all_gather_sequence": "DSA gathers the row's hidden states (forward all-gather; backward all-reduce and local slice)",
    _CP + "all_gather_backward_anchor": "zero-valued edge that keeps every rank in the gather's backward all-reduce",
    _LAYERS
    + "Glm5NextSparseAttention._forward_document": "per document with local queries: latent K/V and KPool pools recomputed from the gathered states",
}

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": {
        "input_ids": "[B, S] int64 token ids (kept global under CP; the forward embeds and slices)",
        "labels": "[B, S] int64 targets, already shifted (within each document when packed); -100 ignored",
    },
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding (unpacked rows)",
        "position_ids": "[B, S] int64 (NoPE attention: the model ignores them)",
        "seq_lens": "[B, D] int64 real document lengths of packed rows (-1000: absent)",
        "seq_lens_padded": "[B, D] int64 physical spans; the CP sharder's document map prefers them",
        "qkv_format": "'thd' on packed batches (the THD collater's marker)",
    },
    "produced_by_sharder": {
        "padding_mask": "[B, S_local] bool, True on padding",
        "glm5_next_packed_context": "replicated document ids [B, S_pad] (0 = padding), this rank's start",
    },
}

# fmt: off
BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
               enable_hf_state_dict_adapter=False)

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
    layer_types=["deepseek_sparse_attention", "deepseek_sparse_attention"], mlp_layer_types=["dense", "sparse"],
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
    index_kpool=2, index_head_dim=8, index_n_heads=2, hc_mult=2, hc_sinkhorn_iters=4, initializer_range=0.2,
    rms_norm_eps=1e-6, num_nextn_predict_layers=0, max_position_embeddings=4096, pad_token_id=0,
)
VISION: dict[str, Any] = dict(
    depth=1, hidden_size=8, num_heads=1, intermediate_size=8, out_hidden_size=16, projection_intermediate_size=8,
    patch_size=2, image_size=4, spatial_merge_size=1,
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Glm5NextConfig:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    name = dtype_name(NAME, dtype)
    return Glm5NextConfig(
        text_config={**tiny(TINY, overrides), "torch_dtype": name}, vision_config={**VISION, "torch_dtype": name}
    )


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``Glm5NextForConditionalGeneration`` on CPU in train mode, seeded, all-zero trainable parameters redrawn;
    parameters in ``dtype`` except the ones the framework keeps in float32 (mHC base/scale, router correction bias).
    """
    return build_seeded(
        lambda: Glm5NextForConditionalGeneration(config(dtype, **overrides), backend=BackendConfig(**BACKEND)),
        dtype,
        seed,
        nonzero=True,
    )


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """Global length an unpacked row of ``seq_len`` is padded to at ``cp_size`` (a multiple of the CP size)."""
    return padded_length(seq_len, cp_size, cp_size)
