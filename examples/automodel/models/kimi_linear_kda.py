"""Model spec: nemo-automodel 0.7.0's ``KimiLinear48BForCausalLM`` at a tiny random config: fla's KDA
context-parallel kernels, through the model's own contiguous CP sharder.

GPU only (``REQUIRES``): the KDA layer is built from fla (``ShortConvolution``, ``FusedRMSNormGated``) and runs
fla's Triton kernels (``chunk_kda``, ``fused_kda_gate``; under CP ``chunk_kda(cp_context=...)`` and the CP short
convolution); the framework gives no torch path for KDA, so not even the one-device forward runs on a CPU. The
framework's CP setup, ``components/moe/parallelizer.apply_cp``, imports ``transformer_engine`` on its first line
whether or not the model uses TE attention, hence the third requirement. Never run end to end
(``docs/models/gpu_only.md``).

Why this model: the framework's fla CP code serves two families: KDA (``kimi_linear``, this spec: the model owns
the whole CP path) and Gated DeltaNet (``qwen3_5_moe/cp_linear_attn.CPAwareGatedDeltaNet``, used by the Qwen3.5
VLM, Qwen3.5-MoE and Qwen3.8-Flash-Next under the load-balanced layout; the text-only ``Qwen3_5ForCausalLM``
declares ``supports_cp=False``). No GDN spec exists yet (``docs/models/gpu_only.md``, "Not done").

How the spec enters CP (as the recipe does):

1. model setup: ``parallelize_model`` calls ``apply_cp(model, cp_mesh)`` (``components/moe/parallelizer.py``): every
   decoder block's ``self_attn.setup_cp_attention(cp_mesh)`` (KDA and MLA alike; Kimi's blocks declare no
   ``layer_type``, so both take the "full_attention" branch), MoE ``cp_mesh``, ``model._cp_enabled``. The harness
   builds one model per process and runs it at several CP sizes, so the spec calls ``apply_cp`` again whenever the
   mesh changes (the one-device reference does not read the CP mesh: both layers branch on the batch's
   ``KimiPackedContext.cp_enabled``).
2. per step: the batch on the rank's device, ``ContextParallelSharder(model, mesh, batch)``, which calls the
   model's ``prepare_model_inputs_for_cp`` hook (at ``cp_size > 1``) and so gets
   ``shard_batch_for_kimi_cp`` with ``contiguous_local_indices``; ``sharder.shard(batch)``: document ids from
   ``attention_mask`` / ``seq_lens`` (0 = padding), right padding to a multiple of ``cp_size``, rank ``r`` keeps
   ``[r L, (r+1) L)``, ``kimi_packed_context`` (the global document map) added; a null context (the transport lives
   in the layers).
3. forward: KDA layers build fla's per-row CP context (``build_cp_context(cu_seqlens, group,
   conv1d_kernel_size)``: conv boundary tokens and the recurrent state handed rank to rank) and run
   ``chunk_kda(cp_context=...)``; MLA layers all-gather the compressed KV latent (``_AllGatherSequence``: all_gather
   forward, all_reduce + slice backward) and run FlexAttention with a causal per-document block mask.

Interface and shapes: as ``_base``; ``build`` puts the model on ``rank_device()``.
``gather_logits``: ``sharder.gather_token_tensor(trim=True)`` over the contiguous index map, CP padding trimmed.

Batch kinds (``BATCH_KINDS``): ``"plain"``, ``"right_padded"``. Not ``"packed"``: the CP sharder reads the harness's
``seq_lens`` and masks documents, but the one-device model does not read ``seq_lens`` (its one-device packed input
is the loader's NEAT metadata, ``_packed_seq_ids`` / ``packed_token_indices`` / ``cu_seqlens``), so the two runs
would not describe the same batch; wiring that format is not done.

Tiny config (``TINY``): hidden 32, 4 layers alternating KDA (layers 1, 3; 2 heads of 32, short conv 4) and MLA
(layers 2, 4; 2 heads, NoPE, ``kv_lora_rank`` 16, ``qk_nope_head_dim`` 16, ``qk_rope_head_dim`` 16,
``v_head_dim`` 16), layer 0 dense MLP, layers 1-3 MoE with 4 experts (2 active, sigmoid router, one shared
expert); vocabulary 64. Backend ``BackendConfig(linear="torch", rms_norm="torch_fp32", experts="torch",
dispatcher="torch")``. Head sizes are multiples of 16 for fla's Triton kernels (an assumption from reading, not a
measured limit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.kimi_linear.config import KimiLinear48BConfig

from . import _base
from ._base import *  # noqa: F403 - part of the spec interface
from ._base import batch_to, build_seeded, dtype_name, model_device, pad_batch, rank_device, tiny  # noqa: F401
from ._base import gather_trimmed as gather_logits  # noqa: F401 - the spec interface

NAME = "kimi_linear_kda"
FRAMEWORK_CLASS = "nemo_automodel.components.models.kimi_linear.model.KimiLinear48BForCausalLM"
WORLD_SIZES = (1, 2, 3, 4, 8)  # contiguous shards of a row padded to a multiple of cp_size: any size
BATCH_KINDS = ("plain", "right_padded")

BUILD_ERROR_WITHOUT_FLA = (
    "UnavailableError: Kimi Linear requires the flash-linear-attention/fla extra. Install with `uv sync --extra fla`."
)
FORWARD_ERROR_ON_CPU = "RuntimeError: 0 active drivers ([]). There should only be one."
REQUIRES: dict[str, str] = {
    "fla": "the KDA layer is built from fla modules and runs fla's KDA kernels (chunk_kda, fused_kda_gate; under CP "
    "chunk_kda(cp_context=...) and fla.ops.cp.build_cp_context); without fla, build fails with: "
    + BUILD_ERROR_WITHOUT_FLA,
    "cuda": "fla's KDA kernels are Triton GPU kernels and the framework has no torch path for KDA: the one-device "
    "forward needs CUDA too (CPU, fla 0.6.0 and triton 3.9.0 importable: build works, the one-device "
    "forward fails in triton/runtime/driver.py with: " + FORWARD_ERROR_ON_CPU + ")",
    "transformer_engine": "the framework's CP setup apply_cp (components/moe/parallelizer.py) imports "
    "transformer_engine.pytorch.attention.DotProductAttention before anything else, for "
    "every model (Kimi uses no TE attention)",
}
COVERS: dict[str, str] = {
    "nemo_automodel.components.moe.parallelizer.apply_cp": "setup_cp_attention(cp_mesh) on every KDA and MLA block, MoE cp_mesh (model setup)",
    "nemo_automodel.components.models.kimi_linear.model.KimiLinear48BForCausalLM.prepare_model_inputs_for_cp": "hands the dispatch the model-owned contiguous sharder",
    "nemo_automodel.components.models.kimi_linear.cp.shard_batch_for_kimi_cp": "document ids, right padding to a multiple of cp_size, contiguous slices, KimiPackedContext",
    "nemo_automodel.components.distributed.context_parallel.sharder.contiguous_local_indices": "the index map the logits gather uses (rank r: [r L, (r+1) L))",
    "nemo_automodel.components.models.kimi_linear.cp.build_fla_cp_context": "by reading: fla.ops.cp.build_cp_context per row (global cu_seqlens, CP group, conv kernel size)",
    "nemo_automodel.components.models.kimi_linear.model.KimiDeltaAttention._forward_with_cp": "by reading: chunk_kda(cp_context=...) and the CP short convolutions, one row at a time",
    "nemo_automodel.components.models.kimi_linear.cp.all_gather_sequence": "by reading: MLA's compressed KV latent all-gathered (backward: all_reduce, own slice)",
    "nemo_automodel.components.models.kimi_linear.cp.document_causal_flex_attention": "by reading: local queries against the full-sequence keys, causal per-document block mask",
    "nemo_automodel.components.distributed.context_parallel.sharder.ContextParallelSharder.gather_token_tensor": "differentiable all_gather of the logits, global order, CP padding trimmed",
}

BACKEND = dict(linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.2, pad_token_id=0, tie_word_embeddings=False,
    use_cache=False, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    mla_use_nope=True, num_experts=4, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16,
    moe_router_activation_func="sigmoid", first_k_dense_replace=1, num_expert_group=1, topk_group=1,
    linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 32, "num_heads": 2,
                        "short_conv_kernel_size": 4},
    kda_mode="chunk",
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> KimiLinear48BConfig:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    return KimiLinear48BConfig(**tiny(TINY, overrides), torch_dtype=dtype_name(NAME, dtype))


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model with seeded random weights, on ``rank_device()``, in train mode.

    Weights are drawn on the CPU (``initialize_weights(buffer_device=cpu)``) so that every rank and device gets the
    same values. Raises the framework's ``UnavailableError`` when fla is not importable.
    """
    from nemo_automodel.components.models.kimi_linear.model import KimiLinear48BForCausalLM

    cfg = config(dtype, **overrides)
    return build_seeded(lambda: KimiLinear48BForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed).to(
        rank_device()
    )


def _apply_cp_once(model: torch.nn.Module, mesh: Any) -> None:
    """The recipe's model-setup step ``apply_cp(model, mesh)``, again whenever this model meets another CP mesh."""
    if getattr(model, "_cp_harness_cp_mesh", None) is mesh:
        return
    from nemo_automodel.components.moe.parallelizer import apply_cp

    apply_cp(model, mesh)
    model._cp_harness_cp_mesh = mesh


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """Enter CP the framework's way (``apply_cp`` at a new CP mesh, then the recipe's sharder on a device copy).

    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch``: ``input_ids``, ``labels``, ``position_ids``,
        ``padding_mask`` ``[B, S_local]`` and ``kimi_packed_context`` (global document ids ``[B, S_padded]``).
    """
    if mesh is not None and mesh.size() > 1:
        _apply_cp_once(model, mesh)
    return _base.shard(model, mesh, batch_to(batch, model_device(model)), padding_token_id)


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """Global length an unpacked row of ``seq_len`` is padded to at ``cp_size``: a multiple of ``cp_size``."""
    return seq_len + (-seq_len) % max(cp_size, 1)
