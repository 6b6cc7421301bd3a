"""Subject: ``cached_ulysses_attention`` (``components/speculative/eagle/ulysses_attention.py``), the EAGLE-3
draft's CP attention at ``cp_mode="ulysses"``: ``Eagle3LlamaAttention._cp_ulysses_attention_forward`` calls
``cached_ulysses_attention(q, cache_k, cache_v, cp_group, scale, cu_seqlens, max_seqlen)`` on the contiguous shard;
block 0 is all-to-all'd sequence -> heads, one causal (dense, or varlen with the GLOBAL packed ``cu_seqlens``)
attention over the full sequence, all-to-all'd back; blocks ``1..`` are diagonals merged locally. The recipe
requires the draft's head count divisible by ``cp_size`` (the check draws heads so)."""

from __future__ import annotations

from examples.automodel.attention._eagle import (  # noqa: F401 - DTYPES, STANDINS, WORLD_SIZES: the subject interface
    DTYPES,
    STANDINS,
    WORLD_SIZES,
    contiguous_positions,
    contiguous_shift,
    ulysses_attention,
)

NAME = "eagle_ulysses"
FRAMEWORK_FUNCTION = "nemo_automodel.components.speculative.eagle.ulysses_attention.cached_ulysses_attention"
# Framework callable -> what this subject's CP path does with it (the coverage table of scripts/real_clients).
COVERS: dict[str, str] = {
    "nemo_automodel.components.speculative.eagle.core._cp_shift_left": "the trainer's TTT left shift on this layout (p2p of the shard heads), judged bit for bit",
    "nemo_automodel.components.speculative.eagle.ulysses_attention.cached_ulysses_attention": "the draft's ulysses-mode CP attention (dense, or packed with global cu_seqlens)",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._CachedUlyssesAttention": "its autograd Function: all-to-alls, one block-0 attention, diagonal merge, hand-written backward",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._gather_seq_scatter_heads": "sequence-sharded -> head-sharded all-to-all",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._scatter_seq_gather_heads": "head-sharded -> sequence-sharded all-to-all",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._gather_lse": "the merged LSE all-to-all'd to head shards for the backward",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._scatter_lse": "the block-0 LSE all-to-all'd back to sequence shards",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._block0_forward": "block-0 causal attention over the gathered sequence (dense or varlen)",
    "nemo_automodel.components.speculative.eagle.ulysses_attention._block0_backward": "its backward against the merged out/LSE",
    "nemo_automodel.components.speculative.eagle.ring_attention._merge_diag": "the TTT diagonals merged into block 0's out/LSE",
}
PACKED = True
HEADS_DIVISIBLE = True


def seq_multiple(cp_size: int) -> int:
    return cp_size


local_positions = contiguous_positions
trainer_shift = contiguous_shift


def attention(q, cache_k, cache_v, group, scale, cu_seqlens=None):
    """``[B, T_local, H, D]``; ``cu_seqlens``: GLOBAL document boundaries ``[docs + 1]`` int32 (or ``None``), with
    ``max_seqlen`` the longest document, as the draft passes them."""
    max_seqlen = None if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return ulysses_attention.cached_ulysses_attention(q, cache_k, cache_v, group, scale, cu_seqlens, max_seqlen)
