"""What the three EAGLE-3 subjects share: the framework's modules (imported through ``flash_attn_cpu``, which knows
how to import them without the eagle package's ``__init__``: docs/standins.md) and its sequence sharding.

The sharding is ``TrainEagle3Recipe._maybe_shard_cp`` (``nemo_automodel/recipes/llm/train_eagle3.py``): every
``[batch, sequence, ...]`` tensor is ``index_select``-ed along dim 1 with a global index, contiguous
(``arange(r * L, (r + 1) * L)``, ``L = S / N``) by default and for Ulysses, zig-zag when ``cp_zigzag`` (``c = S /
2N``: ``cat(arange(r c, (r+1) c), arange((2N-1-r) c, (2N-r) c))``, rank ``r`` owns chunks ``r`` and ``2N-1-r``,
early then late; ``_cp_shift_left_zigzag`` in ``core.py`` assumes the same ``[early | late]`` order). The recipe
module cannot be imported here (it imports ``torchao`` through the QAT module), so the index is built here, the
recipe's two formulas, and the recipe's own divisibility errors are the subjects' ``seq_multiple``. Each case also
runs the trainer's own TTT left shift (``core._cp_shift_left`` / ``_cp_shift_left_zigzag``) on the index map, which
must reproduce the global left shift: the layout is the one the framework's training code assumes.
"""

from __future__ import annotations

import importlib

import torch

from cp_harness.standins import flash_attn_cpu

ring_attention, zigzag_ring_attention, ulysses_attention = flash_attn_cpu.framework_modules()
# The trainer (Eagle3TrainerModule): its TTT left shifts assume the recipe's layouts (``trainer_shift``).
core = importlib.import_module(f"{flash_attn_cpu.PACKAGE}.core")

STANDINS = ("flash_attn_cpu",)
WORLD_SIZES = (1, 2, 3, 4)
# flash-attn 2.8's kernels take fp16 / bf16 only (the stand-in refuses float32 as they do): docs/real_clients.md
DTYPES = ("bfloat16", "float16")


def one_device(q, cache_k, cache_v, group, scale, cu_seqlens=None):
    """CP size 1. The recipe attaches no CP attention at ``cp_size <= 1``, so one device is the EAGLE-3 joint softmax
    with ONE flash-attn call over the whole sequence and the same LSE merge of the diagonals: the framework's
    ``cached_ulysses_attention`` on a group of one, whose all-to-alls return their input (no collective call). The
    ring's own backward at world size 1 would send dK/dV to this rank itself (``d_kv_comm.send_recv`` on every
    step), a call training never makes."""
    max_seqlen = None if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return ulysses_attention.cached_ulysses_attention(q, cache_k, cache_v, group, scale, cu_seqlens, max_seqlen)


def contiguous_shift(tokens: torch.Tensor, group) -> torch.Tensor:
    """The trainer's per-TTT-step left shift of a contiguous shard ``[B, S/N]`` (``core._cp_shift_left``)."""
    return core._cp_shift_left(tokens, group)


def zigzag_shift(tokens: torch.Tensor, group) -> torch.Tensor:
    """The trainer's left shift of a zig-zag shard ``[B, S/N]`` (``core._cp_shift_left_zigzag``)."""
    return core._cp_shift_left_zigzag(tokens, group)


def contiguous_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[S / N]`` int64: the contiguous shard of rank ``cp_rank``."""
    local = seq_len // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local)


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[S / N]`` int64: chunks ``cp_rank`` and ``2N-1-cp_rank`` of ``2N``, early then late."""
    c = seq_len // (2 * cp_size)
    return torch.cat(
        (
            torch.arange(cp_rank * c, (cp_rank + 1) * c),
            torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c),
        )
    )
