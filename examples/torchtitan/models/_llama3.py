"""What the torchtitan llama3 specs share: torchtitan 0.3.0's ``Llama3Model`` at a tiny config, built the way its
trainer builds it, through its CP entry with FlexAttention and document block masks.

How the trainer enters CP (``torchtitan/trainer.py``, ``models/llama3/parallelize.py``), and what the specs call:

1. model setup: ``model_config.build()`` on the meta device, ``parallelize_llama``, ``to_empty``,
   ``init_weights`` under no_grad, ``train()``. At ``cp > 1`` (``spmd_backend`` default ``"partial_dtensor"``)
   ``parallelize_llama`` calls ``apply_cp_to_forward([block.attention.inner_attention ...], cp_mesh)``: each
   FlexAttention's forward all-gathers K/V over the CP group (torch's ``flex_cp_allgather``, whose backward
   reduce-scatters dK/dV) and attends its local queries to the global K/V. The specs call it inside
   ``ctx_factory()`` and remove the wrappers on exit (the harness runs the one-device reference on the same model
   object). Not called: ``apply_fsdp_to_decoder`` (FSDP over a data-parallel mesh of one rank here; the harness
   sums the CP group's parameter gradients itself, as FSDP over ``dp_shard_cp`` does).
2. per step (``Trainer.post_dataloading_process``): ``model.get_attention_masks(positions=...)`` (causal AND
   ``get_efficient_causal_mask_mod_for_packed_document``: a ``BlockMask`` of document-causal attention, documents
   starting where ``positions`` is 0), then ``prepare_context_parallel_input(inputs, labels, {"positions",
   "attention_masks"}, cp_mesh, device, load_balancer)``: ``cp_shard`` builds torch's ``_HeadTailLoadBalancer``
   (``"headtail"``, the config default) or ``_PTRRLoadBalancer`` from the block mask (``"ptrr"``) and shards
   tokens, labels and positions (torch's ``_context_parallel_shard``, sequence dim 1) and the block mask on its
   query dim (torch rewrites its ``mask_mod`` through the balancer's indices).
3. forward ``model(tokens, positions=, attention_masks=)``, loss ``CrossEntropyLoss`` (sum over the rank's labels /
   the global label count: the trainer's ``global_valid_tokens``).

torchtitan never gathers the sequence back (its loss is local); the specs' ``gather_logits`` is torch's
``context_parallel_unshard`` with the very balancer object torchtitan's ``cp_shard`` built (recorded by a spy on
its call of ``_context_parallel_shard``, which passes the call through unchanged).

The row: torch's CP block mask needs the global length divisible by ``cp_size * 128`` (``_create_cp_block_mask``:
``NotImplementedError: Q_LEN 16 is not divisible by CP mesh world size 2 * BLOCK_SIZE 128``), and torchtitan's data
loader emits rows of the configured ``seq_len``. At ``cp > 1`` the spec right-pads the caller's row to that
multiple (``cp_padded_length``): tokens 0, labels -100, the padding its own document (positions from 0), so no
real token attends to it. A drawn row of 2-24 tokens then lies in the first chunk (rank 0's); the default command's
smoke and the fixtures use rows of 150-380 tokens, which every rank's chunks hold.

CPU only, two substitutions, both named in the reports' stand-in line or here:

- FlexAttention uncompiled. torchtitan compiles it (``FlexAttention._compiled_flex_attn``, a class variable, and
  ``attention._compiled_create_block_mask``); on a CPU torch 2.13's inductor refuses the training call. Around
  mask creation and forward the specs hand torch's own ``flex_attention`` / ``create_block_mask`` to those two
  slots (``_eager_flex``), one device and CP alike, and put torchtitan's back on exit. On a GPU nothing changes.
- FlexAttention's CPU backward: the stand-in ``flex_backward_cpu_all_runs`` (``cp_harness.standins``), entered
  around the CP step *and* the one-device runs, because torchtitan's llama3 has no other attention for language
  models (``get_attention_config("sdpa")`` raises "sdpa is no longer supported for language models").

Interface and shapes (``cp_harness/usage/spec_contract.py``): ``B`` rows, ``S`` the caller's length, ``L`` the CP
padded length, ``S_local = L / cp_size``, ``V`` = 64.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.distributed.tensor.experimental._attention import context_parallel_unshard
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.distributed.context_parallel import api as titan_cp
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common import attention as titan_attention
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    _build_llama3_layers,
    _output_linear_init,
)

from examples.automodel.models._base import IGNORE_INDEX, make_batch, num_label_tokens, seeded, valid_positions

__all__ = ["make_batch", "num_label_tokens", "valid_positions"]

DTYPES = (torch.float32,)  # the trainer keeps parameters in float32 (training.dtype); bf16 is FSDP's mixed precision
WORLD_SIZES = (1, 2, 3, 4)
BATCH_KINDS = ("plain", "right_padded", "packed")
STANDINS = ("flex_backward_cpu_all_runs",)
MASK_BLOCK = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE, which _create_cp_block_mask requires per rank

# The llama3 "debugmodel" flavour's structure (torchtitan/models/llama3/__init__.py ``_debugmodel``) at a tiny size:
# the same builder, inits, ComplexRoPE with llama scaling, fused QKV; GQA (2 key/value heads) as the 8B flavour.
TINY: dict[str, Any] = dict(
    dim=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=64, multiple_of=32, max_seq_len=2048, rope_theta=500000.0
)

_SHARD = "torchtitan.distributed.context_parallel.api."
_TORCH_CP = "torch.distributed.tensor.experimental._context_parallel._attention."
COVERS_COMMON: dict[str, str] = {
    _SHARD + "apply_cp_to_forward": "wraps each FlexAttention's forward: K/V all-gathered over the CP group",
    _SHARD + "prepare_context_parallel_input": "the trainer's per-step call: tokens, labels, positions, block mask",
    _SHARD + "cp_shard": "builds the load balancer, shards the buffers (seq dim 1) and the block mask (query dim)",
    "torchtitan.models.common.decoder.Decoder.get_attention_masks": "causal AND packed-document BlockMask",
    "torchtitan.models.common.attention.get_efficient_causal_mask_mod_for_packed_document": "document bounds from positions",
    "torchtitan.components.loss.CrossEntropyLoss": "sum over the rank's labels / the global label count",
    _TORCH_CP + "_context_parallel_shard": "the balancer's rearrangement, then each rank's contiguous slice",
    _TORCH_CP
    + "_create_cp_block_mask": "the local-query block mask, mask_mod rewritten through the balancer's indices",
    "torch.distributed.tensor.experimental._context_parallel._cp_custom_ops.flex_cp_allgather": "K/V all-gather; backward reduce-scatters dK/dV",
    _TORCH_CP + "context_parallel_unshard": "gather_logits: all-gather, then the balancer's restore indices",
}


def config(**overrides: Any) -> Llama3Model.Config:
    """The tiny ``Llama3Model.Config`` (``TINY`` with ``overrides``), FlexAttention."""
    t = {**TINY, **overrides}
    dim, heads = t["dim"], t["n_heads"]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=t["vocab_size"],
        tok_embeddings=Embedding.Config(num_embeddings=t["vocab_size"], embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=t["vocab_size"], param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=t["n_layers"],
            dim=dim,
            n_heads=heads,
            n_kv_heads=t["n_kv_heads"],
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=t["multiple_of"]),
            rope=ComplexRoPE.Config(
                dim=dim // heads, max_seq_len=t["max_seq_len"], theta=t["rope_theta"], scaling="llama"
            ),
            attn_backend="flex",
        ),
    )


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The trainer's build: ``config().build()`` on the meta device, ``to_empty`` on the CPU, ``init_weights`` under
    no_grad and ``seed`` (the caller's RNG state restored), ``train()``. Every parameter in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(
            f"torchtitan llama3 spec: dtype {dtype} not supported (supported: {DTYPES}; the trainer "
            "keeps parameters in float32)"
        )
    with torch.device("meta"):
        model = config(**overrides).build()
    model.to_empty(device="cpu")
    with seeded(seed), torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.to(dtype).train()


@contextlib.contextmanager
def _eager_flex(device: torch.device) -> Iterator[None]:
    """On a CPU: torch's uncompiled ``flex_attention`` / ``create_block_mask`` in torchtitan's two compiled slots for
    the block (module docstring), torchtitan's put back on exit. Elsewhere: nothing."""
    if device.type != "cpu":
        yield
        return
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cls = titan_attention.FlexAttention
    saved = (cls.__dict__["_compiled_flex_attn"], titan_attention._compiled_create_block_mask)
    cls._compiled_flex_attn = staticmethod(flex_attention)
    titan_attention._compiled_create_block_mask = create_block_mask
    try:
        yield
    finally:
        cls._compiled_flex_attn, titan_attention._compiled_create_block_mask = saved


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def positions(batch: dict[str, Any], length: int) -> torch.Tensor:
    """``[B, length]`` int64 per-document positions as torchtitan's data loaders emit them (0 at each document start):
    a packed row's documents (``seq_lens``; span ``seq_lens_padded`` when given), an unpacked row one document of
    ``S`` tokens; what is left up to ``length`` (packing padding, CP padding) one more document."""
    rows, seq_len = batch["input_ids"].shape
    out = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        if batch.get("seq_lens") is not None:
            lengths = batch["seq_lens"][row].tolist()
            spans = batch.get("seq_lens_padded", batch["seq_lens"])[row].tolist()
            spans = [s for n, s in zip(lengths, spans) if n not in (0, -1000)]
        else:
            spans = [seq_len]
        start = 0
        for span in spans + [length - sum(spans)]:
            out[row, start : start + span] = torch.arange(span)
            start += span
    return out


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """``seq_len`` rounded up to a multiple of ``cp_size * 128`` at ``cp_size > 1`` (torch's CP block mask)."""
    multiple = cp_size * MASK_BLOCK
    return seq_len if cp_size <= 1 else seq_len + (-seq_len) % multiple


@dataclasses.dataclass
class Sharded:
    """What ``gather_logits`` needs: the CP mesh (``None``: one device), the caller's length ``S`` and the load
    balancer torchtitan's ``cp_shard`` built (``None``: no balancing, or one device)."""

    mesh: Any
    seq_len: int
    load_balancer: Any = None


@contextlib.contextmanager
def _recording_balancer(record: Sharded) -> Iterator[None]:
    """Record the ``load_balancer`` torchtitan's ``cp_shard`` passes to torch's ``_context_parallel_shard`` (the
    call itself passes through unchanged)."""
    original = titan_cp._context_parallel_shard

    def spy(*args: Any, **kwargs: Any) -> Any:
        record.load_balancer = kwargs.get("load_balancer")
        return original(*args, **kwargs)

    titan_cp._context_parallel_shard = spy
    try:
        yield
    finally:
        titan_cp._context_parallel_shard = original


@contextlib.contextmanager
def _cp_forward(model: torch.nn.Module, mesh: Any) -> Iterator[None]:
    """``apply_cp_to_forward`` on every block's inner attention (``parallelize_llama``'s CP step) for the block; the
    instance ``forward`` wrappers it set removed on exit."""
    layers: Any = model.layers  # Llama3Model's ModuleDict of blocks (nn.Module's __getattr__ types it loosely)
    inner = [block.attention.inner_attention for block in layers.values()]
    titan_cp.apply_cp_to_forward(inner, mesh)
    try:
        yield
    finally:
        for module in inner:
            module.__dict__.pop("forward", None)


def shard_with(
    model: torch.nn.Module, mesh: Any, batch: dict[str, Any], load_balancer: str | None
) -> tuple[Callable[[], Any], dict[str, Any], Sharded]:
    """Enter CP the trainer's way (module docstring, steps 1-2) with ``load_balancer`` (``"headtail"``, ``"ptrr"``).

    Args:
        model: From ``build``.
        mesh: 1-D ``DeviceMesh`` named ``("cp",)``, or ``None`` / one rank (one device: no CP, no padding).
        batch: Global batch (``input_ids``, ``labels`` ``[B, S]``; ``seq_lens`` when packed); not mutated.
    Returns:
        ``(ctx_factory, local_batch, sharder)``; ``local_batch``: ``tokens``, ``labels``, ``positions``
        ``[B, S_local]`` and ``attention_masks`` (this rank's ``BlockMask``).
    """
    device = _device(model)
    seq_len = batch["input_ids"].shape[1]
    cp = mesh is not None and mesh.size() > 1
    length = cp_padded_length(model, seq_len, mesh.size() if cp else 1)
    tokens = torch.zeros(batch["input_ids"].shape[0], length, dtype=torch.long)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    tokens[:, :seq_len], labels[:, :seq_len] = batch["input_ids"], batch["labels"]
    tokens, labels, pos = tokens.to(device), labels.to(device), positions(batch, length).to(device)
    with _eager_flex(device):
        masks = cast(Any, model).get_attention_masks(positions=pos)  # Decoder.get_attention_masks
    sharder = Sharded(mesh if cp else None, seq_len)
    if not cp:
        return (
            contextlib.nullcontext,
            {"tokens": tokens, "labels": labels, "positions": pos, "attention_masks": masks},
            sharder,
        )
    with _eager_flex(device), _recording_balancer(sharder):
        tokens, labels, extra = titan_cp.prepare_context_parallel_input(
            tokens, labels, {"positions": pos, "attention_masks": masks}, mesh, device, load_balancer
        )
    local = {"tokens": tokens, "labels": labels, **extra}
    return (lambda: _cp_forward(model, mesh)), local, sharder


def forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """``model(tokens, positions=, attention_masks=)``: logits ``[B, S_local, V]`` in the model dtype."""
    with _eager_flex(_device(model)):
        return model(
            local_batch["tokens"], positions=local_batch["positions"], attention_masks=local_batch["attention_masks"]
        )


def local_labels(local_batch: dict[str, Any]) -> torch.Tensor:
    """This rank's labels ``[B, S_local]`` as ``cp_shard`` laid them out."""
    return local_batch["labels"]


def gather_logits(sharder: Sharded, local_logits: torch.Tensor) -> torch.Tensor:
    """``[B, S_local, V]`` -> ``[B, S, V]``: torch's ``context_parallel_unshard`` with torchtitan's balancer, the CP
    padding cut off."""
    if sharder.mesh is None:
        return local_logits[:, : sharder.seq_len]
    (full,) = context_parallel_unshard(sharder.mesh, [local_logits.detach()], [1], sharder.load_balancer)
    return full[:, : sharder.seq_len]


def loss(logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: int) -> torch.Tensor:
    """torchtitan's ``CrossEntropyLoss``: summed cross entropy over ``labels`` (-100 ignored) / the global count."""
    value, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(
        logits, labels, global_valid_tokens=torch.tensor(num_label_tokens, device=logits.device)
    )
    return value
