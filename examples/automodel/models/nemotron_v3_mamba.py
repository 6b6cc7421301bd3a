"""Model spec: nemo-automodel 0.7.0's ``NemotronHForCausalLM`` (Nemotron V3 hybrid Mamba2 / attention) at a tiny
random config with SDPA attention: the Mamba all-to-all ("hidden parallel") CP together with the framework's
default load-balanced ring SDPA for the attention layers.

On a GPU the Mamba2 mixer's training path is ``mamba_ssm``'s fused Triton kernel
(``mamba_split_conv1d_scan_combined``) and its gated RMSNorm ``mamba_ssm``'s Triton ``rmsnorm_fn``; the framework
gives no torch path, and the attention layers' CP is torch's ring SDPA (CUDA kernels only, see
``load_balanced_sdpa``). On a CPU both run on stand-ins (``STANDINS``, ``docs/standins.md``): ``ring_sdpa_cpu``
(torch's whole ring, the CPU flash kernel per step) and ``mamba_kernels_cpu`` (mamba_ssm's and causal_conv1d's
kernel entry points routed to the packages' own torch references, ``mamba_split_conv1d_scan_ref`` with the fused
kernel's RMSNorm group size, ``rms_norm_ref``, ``causal_conv1d_ref``, ``selective_scan_ref``). The Mamba kernels
have no CPU implementation at all, so that stand-in also serves the one-device reference: CP and one device
compute with the same references, and what is judged, logits and every parameter gradient, is the framework's CP
code (the all-to-alls, the layout undo / redo, the head and group slices), not the Triton kernels' rounding, which
only the GPU nightly judges. The packages are the CPU build of ``constraints/mamba.txt`` (no CUDA extension). The
page: ``docs/models/nemotron_v3_mamba.md`` (verify: float32 passes with every gradient judged; bfloat16 fails on the
float32 parameter ``D``'s gradient only, M6: the CP mixer's kernel calls round differently from the one-device
mixer's fused call, which ``cp_kernels`` makes the one-device forward use).

How the spec enters CP (as the recipe does):

1. model setup, Nemotron-H's own parallelizer (``nemotron_v3/parallelization.py``,
   ``NemotronHModelParallelizer._apply``, CP part): every ``mamba`` block's ``mixer.cp =
   MambaContextParallel(cp_group, num_heads, head_dim, n_groups, d_state, mixer)``; attention blocks are given a TE
   CP group only when their ``attn_module`` is a TE ``DotProductAttention`` (not here: SDPA). ``_apply`` also shards
   with FSDP, which the harness does not judge, so the spec makes exactly the CP assignments of that loop (the
   framework's class, constructed with the arguments the parallelizer passes), again whenever the model meets a new
   CP mesh. Then ``_transformers/infrastructure.py``'s ``attach_context_parallel_hooks(model)`` (dense model,
   ``cp_size > 1``, not TE), for the CP step only, as in ``load_balanced_sdpa``.
2. per step: the batch on the rank's device, ``ContextParallelSharder(model, mesh, batch)`` (no model hook, not TE:
   the generic ``shard_batch_load_balanced``), ``sharder.shard(batch)``, the forward inside its train context.
3. forward: attention layers run torch's ring SDPA on the head-tail layout; each Mamba layer's
   ``MambaContextParallel.pre_conv_ssm`` undoes the load balancing (``_undo_attention_load_balancing``: chunk
   reorder to rank order) and all-to-alls ``[B, S/N, D] -> [B, S, D/N]`` (``_AllToAll``: all_to_all_single, its own
   backward), the kernel runs the full sequence on ``heads / N`` heads with its slices of conv, ``dt_bias``,
   ``A_log``, ``D``, and ``post_conv_ssm`` all-to-alls back and redoes the load balancing.

Interface and shapes: as ``load_balanced_sdpa`` (the same sharder and layout; logits ``[B, S_local, V]``).

Batch kinds (``BATCH_KINDS``): ``"plain"``, ``"right_padded"`` (the load-balanced path has no document masking).

Tiny config (``TINY``): hidden 32, 4 blocks ``mamba, attention, mamba, mlp``; Mamba2 with 8 heads of 8, 8 groups,
state 16, conv 4, chunk 16 (``MambaContextParallel`` needs ``heads % cp == 0`` and groups divisible by, or dividing,
``cp``: ``WORLD_SIZES`` 1, 2, 4, 8); attention 2 query / 2 key-value heads of 16, no RoPE; vocabulary 64.
Backend ``BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", rope_fusion=False)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.models.common import BackendConfig
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

from . import _base
from ._base import *  # noqa: F403 - part of the spec interface
from ._base import batch_to, build_seeded, dtype_name, model_device, pad_batch, rank_device, tiny  # noqa: F401
from ._base import gather_trimmed as gather_logits  # noqa: F401 - the spec interface
from .load_balanced_sdpa import BACKEND, _context_parallel_hooks, cp_padded_length  # noqa: F401 - same layout

NAME = "nemotron_v3_mamba"
FRAMEWORK_CLASS = "nemo_automodel.components.models.nemotron_v3.model.NemotronHForCausalLM"
WORLD_SIZES = (1, 2, 4, 8)  # MambaContextParallel: 8 heads and 8 groups split over cp ranks
BATCH_KINDS = ("plain", "right_padded")

FORWARD_ERROR_WITHOUT_MAMBA = "ModuleNotFoundError: No module named 'mamba_ssm'"
# what the CPU install (constraints/mamba.txt: no CUDA extension) gives outside the stand-in: mamba_ssm/__init__.py
# imports the Mamba1 CUDA extension unconditionally
FORWARD_ERROR_CPU_INSTALL = "ModuleNotFoundError: No module named 'selective_scan_cuda'"
REQUIRES: dict[str, str] = {
    "mamba_ssm": "the Mamba2 mixer's training forward is mamba_ssm's fused Triton kernel "
    "(mamba_split_conv1d_scan_combined) and its gated RMSNorm mamba_ssm's rmsnorm_fn; no torch path in the "
    "framework (CPU: build works; the one-device forward fails in nemotron_v3/layers.py with: "
    + FORWARD_ERROR_WITHOUT_MAMBA
    + "; on a CPU the stand-in mamba_kernels_cpu calls the package's torch references, constraints/mamba.txt)",
    "causal_conv1d": "mamba_ssm's fused kernel and its reference call causal_conv1d's causal_conv1d_fn (the "
    "stand-in mamba_kernels_cpu: its causal_conv1d_ref)",
    "cuda": "mamba_ssm's Triton kernels and torch's ring SDPA (attention layers under CP) run on CUDA only; the "
    "one-device forward needs CUDA too (on a CPU: the stand-ins ring_sdpa_cpu and mamba_kernels_cpu)",
}
STANDINS = ("ring_sdpa_cpu", "mamba_kernels_cpu")  # the "cuda" above is for these kernels only; docs/standins.md
COVERS: dict[str, str] = {
    "nemo_automodel.components.distributed.context_parallel.mamba.MambaContextParallel": "per Mamba layer: head / group split over the CP ranks (model setup, as the Nemotron-H parallelizer does)",
    "nemo_automodel.components.distributed.context_parallel.mamba.MambaContextParallel.pre_conv_ssm": "by reading: undo the head-tail layout, all-to-all [B, S/N, D] -> [B, S, D/N]",
    "nemo_automodel.components.distributed.context_parallel.mamba.MambaContextParallel.post_conv_ssm": "by reading: all-to-all back [B, S, D/N] -> [B, S/N, D], redo the head-tail layout",
    "nemo_automodel.components.distributed.context_parallel.mamba._AllToAll": "by reading: all_to_all_single forward and backward",
    "nemo_automodel.components.distributed.context_parallel.utils.attach_context_parallel_hooks": "self_attn pre-hooks (model setup at cp_size > 1; Nemotron's attention is registered as 'mixer')",
    "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_load_balanced": "pops attention_mask, adds position_ids, pads to 2 * cp_size, builds the ring SDPA context",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention": "by reading: ring SDPA of the attention layers (allgather rotater)",
    "nemo_automodel.components.distributed.context_parallel.sharder.ContextParallelSharder.gather_token_tensor": "differentiable all_gather of the logits, round-robin order undone, CP padding trimmed",
}

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, layers_block_type=["mamba", "attention", "mamba", "mlp"], num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, intermediate_size=32, mlp_hidden_act="relu2", ssm_state_size=16,
    mamba_num_heads=8, mamba_head_dim=8, n_groups=8, conv_kernel=4, chunk_size=16, use_conv_bias=True,
    mamba_hidden_act="silu", max_position_embeddings=4096, initializer_range=0.2, layer_norm_epsilon=1e-5,
    tie_word_embeddings=False, use_cache=False, pad_token_id=0, num_nextn_predict_layers=0,
)
# fmt: on


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> NemotronHConfig:
    """The HF ``NemotronHConfig`` for the tiny model (``TINY`` with ``overrides``) in ``dtype``."""
    name = dtype_name(NAME, dtype)
    cfg = NemotronHConfig(**tiny(TINY, overrides))
    cfg.dtype = name  # what the deprecated torch_dtype setter sets
    return cfg


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model with seeded random weights (drawn on the CPU), in ``dtype``, on ``rank_device()``, train mode."""
    from nemo_automodel.components.models.nemotron_v3.model import NemotronHForCausalLM

    cfg = config(dtype, **overrides)
    return build_seeded(lambda: NemotronHForCausalLM(cfg, backend=BackendConfig(**BACKEND)), dtype, seed).to(
        rank_device()
    )


def _mamba_cp_once(model: Any, mesh: Any) -> None:
    """The CP assignments of ``NemotronHModelParallelizer._apply`` for a new CP mesh (Mamba layers only: the
    attention layers here are SDPA, which that loop leaves alone)."""
    if getattr(model, "_cp_harness_cp_mesh", None) is mesh:
        return
    from nemo_automodel.components.distributed.context_parallel.mamba import MambaContextParallel

    cp_group = mesh.get_group()
    for layer in model.model.layers.values():
        if getattr(layer, "block_type", None) == "mamba":
            mixer = layer.mixer
            mixer.cp = MambaContextParallel(
                cp_group=cp_group,
                num_heads=mixer.num_heads,
                head_dim=mixer.head_dim,
                n_groups=mixer.n_groups,
                d_state=mixer.ssm_state_size,
                mixer=mixer,
            )
    model._cp_harness_cp_mesh = mesh


@contextlib.contextmanager
def _mamba_cp_off(model: Any):
    """No Mamba CP for the block: a one-device user's model has ``mixer.cp = None``. A one-rank ``cp``
    (``cp_kernels``: the CP path's kernel calls without CP) is left in place."""
    mixers = [layer.mixer for layer in model.model.layers.values() if getattr(layer, "block_type", None) == "mamba"]
    mixers = [mixer for mixer in mixers if mixer.cp is None or mixer.cp.cp_size > 1]
    saved = [mixer.cp for mixer in mixers]
    for mixer in mixers:
        mixer.cp = None
    try:
        yield
    finally:
        for mixer, cp in zip(mixers, saved):
            mixer.cp = cp


CP_KERNELS = (
    "Mamba mixer by its CP path's kernel calls (mamba_split_conv1d_scan_combined with the gate and without the "
    "RMSNorm / output projection, then rmsnorm_fn and out_proj) instead of the one fused call; attention by SDPA "
    "causal without a mask (the CP batch's call) instead of SDPA with the padding mask"
)


class _OneRank:
    """A CP group of one rank, as ``MambaContextParallel`` reads its group (``size()``, ``rank()``): over it
    ``pre_conv_ssm`` / ``post_conv_ssm`` return their input and the slices are the whole parameters (the
    framework's ``cp_size == 1`` branches); no collective is reached."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _causal_without_mask(attn_func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``attn_func`` (the framework's SDPA callable, ``[B, H, S, D]`` in and out) called as the CP batch makes the
    call: no ``attn_mask`` (``shard_batch_load_balanced`` pops ``attention_mask``), ``is_causal=True``."""

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return attn_func(q, k, v, **{**kwargs, "attn_mask": None, "is_causal": True})

    return causal


@contextlib.contextmanager
def cp_kernels(model: Any) -> Iterator[str]:
    """Inside: the one-device forward of ``model`` computes with the kernel calls its CP path makes.

    * Every Mamba mixer takes its ``self.cp is not None`` branch (the scan with the gate, the separate
      ``rmsnorm_fn``, the output projection), through the framework's ``MambaContextParallel`` over a group of one
      rank (``_OneRank``: no all-to-all, no layout change, whole parameters).
    * Every attention block calls its SDPA function causal and without a mask, as under CP (the sharder pops
      ``attention_mask``; each ring step is SDPA's causal CPU flash kernel), instead of with the boolean
      causal-and-key-padding mask one device passes for padded rows (SDPA's masked path). From every real query of
      a right-padded row both see the same keys.

    Nothing else changes. Its value names the kernels (``CP_KERNELS``); on exit every mixer's own ``cp`` and every
    attention block's own ``attn_func`` are back."""
    from nemo_automodel.components.distributed.context_parallel.mamba import MambaContextParallel

    blocks = list(model.model.layers.values())
    mixers = [layer.mixer for layer in blocks if getattr(layer, "block_type", None) == "mamba"]
    attentions = [layer.mixer for layer in blocks if getattr(layer, "block_type", None) == "attention"]
    saved = [mixer.cp for mixer in mixers]
    saved_funcs = [attention.attn_func for attention in attentions]
    try:
        for mixer in mixers:
            mixer.cp = MambaContextParallel(
                cp_group=_OneRank(),
                num_heads=mixer.num_heads,
                head_dim=mixer.head_dim,
                n_groups=mixer.n_groups,
                d_state=mixer.ssm_state_size,
                mixer=mixer,
            )
        for attention in attentions:
            attention.attn_func = _causal_without_mask(attention.attn_func)
        yield CP_KERNELS
    finally:
        for mixer, cp in zip(mixers, saved):
            mixer.cp = cp
        for attention, func in zip(attentions, saved_funcs):
            attention.attn_func = func


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """Mamba CP at a new CP mesh, then the recipe's sharder on a device copy; ``ctx_factory()`` adds the CP hooks.

    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch`` tensors ``[B, S_local]`` inside ``ctx_factory()``.
    """
    train_ctx, local_batch, sharder = _base.shard(model, mesh, batch_to(batch, model_device(model)), padding_token_id)
    if mesh is None or mesh.size() <= 1:

        @contextlib.contextmanager
        def one_device():
            with _mamba_cp_off(model), train_ctx():
                yield

        return one_device, local_batch, sharder
    _mamba_cp_once(model, mesh)

    @contextlib.contextmanager
    def ctx_factory():
        with _context_parallel_hooks(model), train_ctx():
            yield

    return ctx_factory, local_batch, sharder
