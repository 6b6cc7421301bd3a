"""Model spec: nemo-automodel 0.7.0's ``GlmMoeDsaForCausalLM`` (GLM-5.2, DeepSeek sparse attention) at a tiny
random config with ``backend.attn="tilelang"``: the model-owned packed THD context parallelism (``cp.py``).

GLM DSA runs CP only with ``backend.attn`` in ``{"tilelang", "cudnn"}`` (``prepare_model_inputs_for_cp`` and
``layers.py`` raise ``NotImplementedError`` otherwise). Those are device kernels (TileLang's lighting indexer and
sparse MLA); on a CPU they run on the stand-in ``glm_dsa_kernels_cpu`` (``STANDINS``, ``docs/standins.md``), the
kernels' four entry points computed in torch, around the one-device runs as well (no CPU kernel exists). Every
line of CP code is the framework's: the THD conversion, the query shard, the K/V all-gathers and their backward,
the per-query key windows selected by the global query indices, the autograd functions around the kernels.

How the spec enters CP (as the recipe does):

1. the loader's THD packing (``packing_strategy='thd'``): every document padded to a multiple of ``2 * cp_size``
   (1 at ``cp_size`` 1), ``position_ids`` restarting per document, ``seq_lens`` / ``seq_lens_padded`` ``[B, D]``,
   ``qkv_format="thd"`` (``mimo_v2_flash_te_thd.thd_batch``, the same layout for every THD model);
2. model setup: nothing. GLM's CP state is per batch (the sharder puts ``_glm_dsa_cp_group`` in it); its FSDP2
   parallelizer installs none (measured: ``parallelize_model`` at ``dp_shard x cp = 2 x 2`` leaves no
   ``_cp_enabled``), and the MoE parallelizer's ``apply_cp`` (expert parallelism) would only set flags and a MoE CP
   mesh that GLM never reads (``aux_loss_coeff=0``). So the one-device reference and CP run the same model object;
3. per step: ``ContextParallelSharder(model, mesh, batch)`` calls ``prepare_model_inputs_for_cp``, whose sharder
   is ``cp.shard_glm_dsa_packed_cp_batch``: ``split_batch_into_thd_chunks`` -> ``process_input_for_thd`` (rows
   flattened to one stream ``[T]``, ``cu_seqlens`` real / ``cu_seqlens_padded`` physical, ``padding_mask`` from
   the pack layout), then ``_slice_thd_chunk_for_cp``: rank ``r`` keeps the contiguous tokens ``[r T/N, (r+1)
   T/N)`` (``contiguous_local_indices``) and gets ``glm_dsa_cp_query_indices`` (their global positions) and
   ``_glm_dsa_cp_group``;
4. forward: every MLA layer all-gathers its latent ``kv`` and ``k_pe`` and every indexer its keys
   (``glm_dsa_cp_all_gather``: ``torch.distributed.nn.functional.all_gather``, whose backward reduce-scatters);
   ``tilelang_indexer_topk`` builds each global query's key window from ``cu_seqlens`` / ``cu_seqlens_padded``
   and selects this rank's rows with the query indices; layer 2 (IndexShare ``"shared"``) reuses layer 1's
   selection.

One device: the recipe's dispatch at ``cp_size`` 1 does not call the model's hook (``_prepare_cp_sharder`` reads
``model.supports_thd``, which GLM declares only in its ``ModelCapabilities``), so its identity sharder hands the
model the untransformed rows and the TileLang indexer raises ``ValueError: TileLang DSA indexer requires
'cu_seqlens'`` (``docs/models/glm_moe_dsa.md``, finding DSA1: ``repro/glm_dsa_one_device_no_thd.py``). The
one-device reference therefore converts the rows with the framework's own ``split_batch_into_thd_chunks`` (what
the CP path runs before slicing) and runs the untouched model on the whole stream.

Interface and shapes: as ``mimo_v2_flash_te_thd`` (the same THD layout and gather): ``local_batch`` holds the THD
shard (``input_ids``, ``labels``, ``position_ids``, ``padding_mask`` ``[T_local]``, ``cu_seqlens`` /
``cu_seqlens_padded`` ``[D + 1]`` int32, ``glm_dsa_cp_query_indices`` ``[T_local]`` int32, ``qkv_format``,
``cp_size``, ``cp_rank``, ``_glm_dsa_cp_group``); ``forward -> [1, T_local, V]``; ``local_labels -> [1,
T_local]``; ``gather_logits -> [B, S, V]`` in the harness's rows.

Tiny config (``TINY``): hidden 64, 3 layers (0 dense MLP, 1-2 MoE with 4 experts, 2 active, one shared expert;
indexers ``full, full, shared``), 2 heads, q LoRA 32, NoPE 16, V 16; ``kv_lora_rank`` 512 and
``qk_rope_head_dim`` 64 (the sparse MLA kernel asserts ``512 + 64 = 576``), ``index_topk`` 64 (a multiple of the
kernel's 64-key block; documents longer than 64 tokens select), indexer 4 heads of 128; vocabulary 64, pad id 0.
Backend ``attn="tilelang"``, ``linear="torch"``, ``rms_norm="torch_fp32"``, ``experts="torch"``,
``dispatcher="torch"``, ``rope_fusion=False``.

Dtypes: bfloat16 only. In float32 the indexer's ``should_use_tilelang(..., require_bf16=True)`` refuses the
float32 query/keys (``RuntimeError: ... inputs do not satisfy CUDA bfloat16 tensors``), on a GPU as here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.distributed.context_parallel.sharder import identity_local_indices
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs
from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

from . import _base
from ._base import *  # noqa: F403 - part of the spec interface
from ._base import batch_to, build_seeded, dtype_name, model_device, rank_device, tiny
from .mimo_v2_flash_te_thd import cp_padded_length, gather_logits, local_labels, thd_batch  # noqa: F401 - same layout
from .model_owned_cp import cp_active

NAME = "glm_moe_dsa"
FRAMEWORK_CLASS = "nemo_automodel.components.models.glm_moe_dsa.model.GlmMoeDsaForCausalLM"
# float32: the TileLang indexer dispatch requires bfloat16 (module docstring)
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)
WORLD_SIZES = (1, 2, 3, 4)
TRAINING_DTYPES = ("bfloat16",)  # the training-step rows it runs (cp_harness/checks/training_step.py, STEP_DTYPES)
BATCH_KINDS = ("plain", "right_padded", "packed")
SEQ_LENS_PADDING = -1000

REQUIRES: dict[str, str] = {
    "cuda": "GLM DSA context parallelism runs only with backend.attn='tilelang' or 'cudnn', TileLang / cuDNN kernels "
    "on CUDA bfloat16 tensors (tilelang installed); the one-device path needs them too (on a CPU: the stand-in "
    "glm_dsa_kernels_cpu)",
}
STANDINS = ("glm_dsa_kernels_cpu",)  # the "cuda" above is for these kernels only; docs/standins.md

_CP = "nemo_automodel.components.models.glm_moe_dsa.cp."
_OPT = "nemo_automodel.components.models.glm_moe_dsa.optimized_kernels."
COVERS: dict[str, str] = {
    "nemo_automodel.components.models.glm_moe_dsa.model.GlmMoeDsaForCausalLM.prepare_model_inputs_for_cp": "requires attn in {tilelang, cudnn}, returns the sharder over shard_glm_dsa_packed_cp_batch with the contiguous index map",
    _CP
    + "shard_glm_dsa_packed_cp_batch": "the sharder: layout [B, S] -> stream B*S, then the THD batch and its CP slice",
    _CP
    + "make_glm_dsa_packed_cp_batch_and_ctx": "split_batch_into_thd_chunks, this rank's CP group and rank, the slice",
    _CP
    + "_slice_thd_chunk_for_cp": "contiguous query shard, full cu_seqlens / cu_seqlens_padded, glm_dsa_cp_query_indices, padding_mask sliced",
    "nemo_automodel.components.distributed.thd_utils.split_batch_into_thd_chunks": "num_chunks 1: process_input_for_thd",
    "nemo_automodel.components.distributed.thd_utils.process_input_for_thd": "rows flattened to one THD stream, cu_seqlens (real) / cu_seqlens_padded (physical), padding_mask from the pack layout",
    "nemo_automodel.components.distributed.context_parallel.sharder.contiguous_local_indices": "this rank's query positions [r T/N, (r+1) T/N)",
    _CP
    + "glm_dsa_cp_all_gather": "per layer: latent kv, k_pe and the indexer keys gathered in rank order (differentiable all_gather)",
    _OPT
    + "tilelang_indexer_topk": "per-query key windows (padded layout when cu_seqlens_padded differs) selected by the global query indices",
    _OPT
    + "_generate_padded_varlen_mask_params": "key windows in the padded stream, CP padding keys excluded for real queries",
    _OPT + "tilelang_sparse_attention": "sparse MLA over the gathered latent K/V, w_vc up-projection",
}

BACKEND = dict(attn="tilelang", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
               rope_fusion=False, enable_hf_state_dict_adapter=False)  # fmt: skip

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=16,
    v_head_dim=16, index_topk=64, index_head_dim=128, index_n_heads=4, first_k_dense_replace=1,
    indexer_types=["full", "full", "shared"], max_position_embeddings=4096, initializer_range=0.2,
    rms_norm_eps=1e-6, pad_token_id=0, use_cache=False,
)
# fmt: on

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": {
        "input_ids": "[B, S] int64 token ids",
        "labels": "[B, S] int64 targets, already shifted (within each document when packed); -100 ignored",
    },
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding (unpacked rows: one document, then pack padding)",
        "seq_lens": "[B, D] int64 real document lengths of packed rows (0 / -1000: absent)",
    },
    "produced_by_sharder": {
        "cu_seqlens": "[D + 1] int32 real document offsets of the flattened stream",
        "cu_seqlens_padded": "[D + 1] int32 physical offsets (when they differ: CP padding between documents)",
        "glm_dsa_cp_query_indices": "[T_local] int32 global stream positions of this rank's queries",
        "padding_mask": "[T_local] bool, True on padding",
    },
}


def config(dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> GlmMoeDsaConfig:
    """The HF ``GlmMoeDsaConfig`` for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    cfg = GlmMoeDsaConfig(**tiny(TINY, overrides))
    cfg.dtype = dtype_name(NAME, dtype)  # what the deprecated torch_dtype setter sets
    return cfg


def build(dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model with seeded random weights (drawn on the CPU), in ``dtype``, on ``rank_device()``, train mode;
    the router's correction bias stays float32 (the framework's ``initialize_weights``)."""
    from nemo_automodel.components.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

    cfg = config(dtype, **overrides)
    return build_seeded(lambda: GlmMoeDsaForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed).to(
        rank_device()
    )


def _one_device_thd(cp_mesh: Any, tp_mesh: Any, batch: dict[str, Any], *, loss_mask=None, padding_token_id=0):
    """A ``shard_batch`` for one device: the framework's ``split_batch_into_thd_chunks`` (the CP path's THD
    conversion, ``num_chunks`` 1) and the flat-stream layout ``[B, S] -> B * S`` the CP sharder reports; no slice."""
    from nemo_automodel.components.distributed.context_parallel.sharder import ShardLayout
    from nemo_automodel.components.distributed.thd_utils import split_batch_into_thd_chunks

    del cp_mesh, tp_mesh, loss_mask
    rows = tuple(batch["input_ids"].shape[:2])
    thd = split_batch_into_thd_chunks(
        batch, num_chunks=1, seq_lens_padding_value=SEQ_LENS_PADDING, padding_token_id=padding_token_id
    )
    return contextlib.nullcontext, thd, ShardLayout(padded_seq_len=rows[0] * rows[1], input_row_shape=rows)


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """The loader's THD layout for the mesh's CP size on the model's device, then at CP > 1 the recipe's sharder
    (the model's hook), at one device the framework's THD conversion (``_one_device_thd``).

    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch`` tensors ``[T_local]`` (module docstring).
    """
    cp_size = mesh.size() if mesh is not None else 1
    laid_out, position_map = thd_batch(batch, cp_size)
    laid_out = batch_to(laid_out, model_device(model))
    if cp_active(mesh):
        ctx_factory, local_batch, sharder = _base.shard(model, mesh, laid_out, padding_token_id)
    else:
        sharder = ContextParallelSharder(
            shard_batch=_one_device_thd,
            local_token_global_indices=identity_local_indices,
            padding_token_id=padding_token_id,
        )
        ctx_factory, local_batch = sharder.shard(laid_out)
    sharder._cp_harness_position_map = position_map  # read by gather_logits: laid-out rows -> harness rows
    return ctx_factory, local_batch, sharder


def forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """The model on this rank's THD shard, inside ``ctx_factory()``; logits ``[1, T_local, V]``."""
    kwargs = {key: value for key, value in local_batch.items() if key != "labels"}
    logits = model(**filter_forward_kwargs(model, kwargs)).logits
    return logits if logits.ndim == 3 else logits.unsqueeze(0)
