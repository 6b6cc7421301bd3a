"""Model spec: nemo-automodel 0.7.0's ``LlamaForCausalLM`` with SDPA attention at a tiny random config, through the
framework's *default* CP path, ``shard_batch_load_balanced``: torch ``context_parallel`` with ring SDPA.

Where it runs (``REQUIRES``, ``STANDINS``): torch's ring SDPA registers DTensor handlers for the CUDA flash,
memory-efficient and cuDNN SDPA kernels only; on the CPU the dispatcher picks
``_scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no sharding strategy. On a CPU the spec runs
with gradients on the stand-in ``ring_sdpa_cpu`` (torch's own ring, the CPU flash op as its per-step kernel;
docs/standins.md); with the real CUDA kernels it has never run: no GPU was available (``docs/models/gpu_only.md``).

Why this model and this path: a framework user who trains a dense Llama (``NeMoAutoModelForCausalLM`` resolves
``LlamaForCausalLM`` to this class) with ``distributed.cp_size > 1`` and SDPA attention gets exactly this path: the
class has no ``prepare_model_inputs_for_cp`` hook and does not use TE or magi attention, so
``_resolve_cp_sharder`` falls through to the generic sharder (``shard_batch_load_balanced`` with
``round_robin_local_indices``).

How the spec enters CP (the recipe's steps, in order):

1. model setup (``_transformers/infrastructure.py``, dense model, ``cp_size > 1``, not TE):
   ``attach_context_parallel_hooks(model)``: a forward pre-hook on every ``self_attn`` that replaces the
   ``attention_mask`` keyword with ``None`` and sets ``is_causal=True``. The spec attaches them for the CP step only
   and removes them afterwards: the harness runs the one-device reference on the same model object, and a
   one-device user's model has no such hooks.
2. per step (``recipes/llm/train_ft.py``): the batch moved to the rank's device,
   ``ContextParallelSharder(model, mesh, batch, padding_token_id=...)``, ``sharder.shard(batch)``: pops
   ``attention_mask``, adds ``position_ids``, right-pads ``input_ids`` (0), ``labels`` (-100), ``position_ids`` (0)
   to a multiple of ``2 * cp_size``, and returns the train context of ``create_context_parallel_ctx(...,
   cp_rotate_method="allgather")`` (``set_rotate_method`` then torch ``context_parallel``) inside
   ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``.
3. entering that context shards the buffers in place with torch's head-tail load balancer (rank ``r`` keeps chunks
   ``r`` and ``2N-1-r`` of ``2N``), monkey-patches ``F.scaled_dot_product_attention`` so that Q/K/V become DTensors
   ``Shard(2)`` and SDPA dispatches to the ring (forward: K/V all-gathered once, partial results merged by
   log-sum-exp; backward: K/V again by the rotate method, dK/dV passed on by all-to-all).

Rotate methods: 0.7.0 selects **only ``"allgather"``**: both callers of ``create_context_parallel_ctx``
(``shard_batch_load_balanced`` and ``shard_batch_aux_only``) hard-code it ("TODO: expose through cfg"); no recipe
or config key passes another. Torch's other method, ``"alltoall"``, is judged by the sibling spec
``load_balanced_sdpa_alltoall`` (the same model, torch's ``set_rotate_method("alltoall")`` after the framework's
shard): what a user would get once the TODO is resolved, not what 0.7.0 runs.

Interface and shapes: as ``_base``, with these differences:

``build(dtype=torch.float32, seed=0, **overrides) -> model``
    ``LlamaForCausalLM`` in ``train()`` mode, weights drawn on the CPU under ``seed`` (the HF initializer), cast to
    ``dtype``, then moved to ``rank_device()`` (the rank's GPU under the ``nccl`` pool). ``overrides`` replace
    fields of ``LlamaConfig`` (e.g. ``num_key_value_heads=1`` for GQA, see "Not covered").
``shard(model, mesh, batch, padding_token_id=0) -> (ctx_factory, local_batch, sharder)``
    The recipe's step 2 on a copy of the batch on the model's device; ``ctx_factory()`` enters the hooks (step 1)
    and the framework's train context (step 3). ``local_batch``: ``input_ids``, ``labels``, ``position_ids``
    ``[B, S_local]`` are this rank's shard only *inside* ``ctx_factory()`` (context_parallel shards them on entry).
``forward(model, local_batch) -> logits [B, S_local, V]``
    In the model dtype (the LM head is not kept in float32 here).
``gather_logits(sharder, local_logits) -> [B, S, V]``
    ``sharder.gather_token_tensor(trim=True)``: the round-robin index map, CP padding trimmed.
``cp_padded_length(model, seq_len, cp_size)``
    ``seq_len`` rounded up to a multiple of ``2 * cp_size``.

Batch kinds (``BATCH_KINDS``): ``"plain"``, ``"right_padded"`` and ``"left_padded"`` (rows as the framework's
chat-template formatting emits them with a left-padding tokenizer; under CP they fail on finding S5: the CP hooks
drop the attention mask, so the real tokens attend the padding, ``examples/automodel/repro/models/
left_padding_cp_hooks.py``). Not ``"packed"``: this path has no document
masking (ring SDPA is causal over the whole row), ``LlamaForCausalLM`` reads no ``seq_lens``, and the recipe
refuses CP with packed sequences for models without packed CP routing (``supports_cp_with_sequence_packing``).

Tiny config (``TINY``): hidden 16, 2 layers, 2 query and 2 key/value heads of 8 (MHA), SwiGLU 32, vocabulary 64,
RoPE theta 10000, untied LM head. Backend ``BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32",
rope_fusion=False)`` (``train_ft.py`` turns ``rope_fusion`` off at ``cp_size > 1`` anyway).

Not covered: GQA under float32. With ``attention_mask`` stripped, HF's SDPA integration passes ``enable_gqa=True``
for grouped K/V; the framework's ``sdpa_kernel([FLASH, EFFICIENT])`` leaves float32 only the memory-efficient
kernel, which (torch's SDPA documentation) supports GQA on neither device, so by reading a float32 GQA model finds
no kernel under CP. The default config is MHA so that both dtype rows of the check run the ring (float32: the
memory-efficient ring; bfloat16: the flash ring); ``num_key_value_heads=1`` exercises GQA on the flash ring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.distributed.context_parallel.utils import attach_context_parallel_hooks
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.llama.model import LlamaForCausalLM
from transformers import LlamaConfig

from . import _base
from ._base import *  # noqa: F403 - part of the spec interface
from ._base import DTYPES, batch_to, model_device, pad_batch, rank_device, seeded  # noqa: F401
from ._base import gather_trimmed as gather_logits  # noqa: F401 - the spec interface

NAME = "load_balanced_sdpa"
FRAMEWORK_CLASS = "nemo_automodel.components.models.llama.model.LlamaForCausalLM"
WORLD_SIZES = (1, 2, 3, 4, 8)  # the ring takes any CP size; the padded length is a multiple of 2 * cp_size
BATCH_KINDS = ("plain", "right_padded", "left_padded")
ROTATE_METHOD: str | None = None  # None: the framework's own choice ("allgather"); see load_balanced_sdpa_alltoall

# Reproduced with run-case at CP 2 (gloo, torch 2.13.0+cpu), raised in the first layer's SDPA of the CP forward.
CPU_ERROR = (
    "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
    "sharding strategy registered."
)
REQUIRES: dict[str, str] = {
    "cuda": "torch context_parallel's ring SDPA has DTensor handlers for the CUDA flash / memory-efficient / cuDNN "
    "SDPA kernels only; on the CPU (gloo, torch 2.13) the forward fails with: " + CPU_ERROR,
}
# The "cuda" above is for the ring's per-step kernel only: on the CPU the harness runs torch's own ring with
# the CPU flash kernel as that op (cp_harness.standins.ring_sdpa_cpu); on a GPU the real kernel runs.
STANDINS = ("ring_sdpa_cpu",)
COVERS: dict[str, str] = {
    "nemo_automodel.components.distributed.context_parallel.utils.attach_context_parallel_hooks": "self_attn pre-hooks: attention_mask -> None, is_causal=True (model setup at cp_size > 1)",
    "nemo_automodel.components.distributed.context_parallel.utils._prepare_cp_sharder": "resolves the generic sharder (no model hook, no TE, no magi)",
    "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_load_balanced": "pops attention_mask, adds position_ids, pads to 2 * cp_size, builds the CP context",
    "nemo_automodel.components.distributed.context_parallel.sharder._pad_cp_buffers_to_divisor": "right-pads input_ids 0, labels -100, position_ids 0",
    "nemo_automodel.components.distributed.context_parallel.utils.create_context_parallel_ctx": "set_rotate_method('allgather'), torch context_parallel(buffers, seq dims, no-restore set)",
    "nemo_automodel.components.distributed.context_parallel.utils.get_train_context": "sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION]) around the CP context",
    "nemo_automodel.components.distributed.context_parallel.sharder.round_robin_local_indices": "the index map the gather of the logits uses (head chunk r, tail chunk 2N-1-r)",
    "nemo_automodel.components.distributed.context_parallel.sharder.ContextParallelSharder.gather_token_tensor": "differentiable all_gather of the logits, reordered to global order, CP padding trimmed",
    "torch.distributed.tensor.experimental._context_parallel._attention.context_parallel": "shards the buffers in place (head-tail load balancer), patches F.scaled_dot_product_attention",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention": "ring forward: K/V all-gathered once (allgather rotater), partial outputs merged by log-sum-exp",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention_backward": "ring backward: K/V by the rotate method, dK/dV passed rank to rank by all-to-all (permute_tensor)",
}

BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch_fp32", rope_fusion=False)

# fmt: off
TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
    rope_theta=10000.0, initializer_range=0.2, attention_bias=False, attention_dropout=0.0, mlp_bias=False,
    tie_word_embeddings=False, use_cache=False, pad_token_id=0,
)
# fmt: on


def config(**overrides: Any) -> LlamaConfig:
    """The tiny ``LlamaConfig`` (``TINY`` with ``overrides``), SDPA attention."""
    cfg = LlamaConfig(**{**TINY, **overrides})
    cfg._attn_implementation = "sdpa"
    return cfg


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model with seeded random weights, in ``dtype``, on ``rank_device()``, in train mode.

    Returns:
        ``LlamaForCausalLM``; every parameter in ``dtype``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"{NAME}: dtype {dtype} not supported (supported: {DTYPES})")
    with seeded(seed):  # no initialize_weights: Llama draws its weights in the constructor
        model = LlamaForCausalLM(config(**overrides), backend=BackendConfig(**BACKEND))
    return model.to(dtype=dtype).to(rank_device()).train()


@contextlib.contextmanager
def _context_parallel_hooks(model: torch.nn.Module):
    """``attach_context_parallel_hooks(model)`` for the duration of the block, then the hooks it added removed."""

    def attention_modules():
        return [m for name, m in model.named_modules() if name.endswith("self_attn")]

    before = [set(m._forward_pre_hooks) for m in attention_modules()]
    attach_context_parallel_hooks(model)
    try:
        yield
    finally:
        for module, keys in zip(attention_modules(), before):
            for key in set(module._forward_pre_hooks) - keys:
                module._forward_pre_hooks.pop(key)
                module._forward_pre_hooks_with_kwargs.pop(key, None)


@contextlib.contextmanager
def _rotate_method(method: str | None):
    """torch's ``set_rotate_method(method)`` inside the block (after the framework set its own), restored after."""
    if method is None:
        yield
        return
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    previous = _cp_options.rotate_method
    set_rotate_method(method)
    try:
        yield
    finally:
        _cp_options.rotate_method = previous


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """Enter CP the framework's way: the batch on the model's device, ``ContextParallelSharder(model, mesh, batch)``,
    ``shard``; with a CP mesh, ``ctx_factory()`` also holds the CP hooks (and ``ROTATE_METHOD``, when set).

    Args:
        model: From ``build``.
        mesh: 1-D ``DeviceMesh`` named ``("cp",)``, or ``None`` (one device: the identity sharder).
        batch: Global batch (``_base.BATCH_KEYS``, unpacked); not mutated.
    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch`` tensors are ``[B, S_local]`` inside ``ctx_factory()``.
    """
    return shard_with_rotate_method(model, mesh, batch, padding_token_id=padding_token_id, rotate_method=ROTATE_METHOD)


def shard_with_rotate_method(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    *,
    padding_token_id: int = 0,
    rotate_method: str | None = None,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """``shard`` with torch's ``set_rotate_method(rotate_method)`` inside ``ctx_factory()`` (``None``: the
    framework's own, ``"allgather"``)."""
    train_ctx, local_batch, sharder = _base.shard(model, mesh, batch_to(batch, model_device(model)), padding_token_id)
    if mesh is None or mesh.size() <= 1:
        return train_ctx, local_batch, sharder

    @contextlib.contextmanager
    def ctx_factory():
        with _context_parallel_hooks(model), train_ctx(), _rotate_method(rotate_method):
            yield

    return ctx_factory, local_batch, sharder


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """Global length an unpacked row of ``seq_len`` is padded to at ``cp_size``: a multiple of ``2 * cp_size``."""
    return _base.padded_length(seq_len, cp_size, 2 * cp_size)
