"""Subject: ``cached_ring_attention`` (``components/speculative/eagle/ring_attention.py``), the EAGLE-3 draft's CP
attention at ``cp_mode="ring"`` without zig-zag: ``Eagle3LlamaAttention._cp_ring_attention_forward`` calls
``cached_ring_attention(q [B, T, H, D], cache_k, cache_v, cp_group, head_dim ** -0.5)`` with this TTT step's query
and every step's cached K/V so far (lists of ``[B, T, H, D]`` in the draft's compute dtype), on the contiguous shard.
Block 0 is a causal ring (K/V rotated p2p, LSE merge, dK/dV passed back); blocks ``1..`` are per-position
diagonals merged locally. Packed sequences are refused by the recipe in ring mode (``PACKED = False``)."""

from __future__ import annotations

from examples.automodel.attention._eagle import (  # noqa: F401 - DTYPES, STANDINS, WORLD_SIZES: the subject interface
    DTYPES,
    STANDINS,
    WORLD_SIZES,
    contiguous_positions,
    contiguous_shift,
    one_device,
    ring_attention,
)

NAME = "eagle_ring"
FRAMEWORK_FUNCTION = "nemo_automodel.components.speculative.eagle.ring_attention.cached_ring_attention"
# Framework callable -> what this subject's CP path does with it (the coverage table of scripts/real_clients).
COVERS: dict[str, str] = {
    "nemo_automodel.components.speculative.eagle.core._cp_shift_left": "the trainer's TTT left shift on this layout (p2p of the shard heads), judged bit for bit",
    "nemo_automodel.components.speculative.eagle.ring_attention.cached_ring_attention": "the draft's ring-mode CP attention, called with q and the TTT blocks' K/V lists",
    "nemo_automodel.components.speculative.eagle.ring_attention._CachedRingAttention": "its autograd Function: block-0 ring, diagonal merge, the hand-written backward against the merged out/LSE",
    "nemo_automodel.components.speculative.eagle.ring_attention.ring_flash_attn_forward": "contiguous causal ring forward: K/V rotated p2p, blocks step <= rank, LSE merge",
    "nemo_automodel.components.speculative.eagle.ring_attention.ring_flash_attn_backward": "ring backward: K/V rotated again, dK/dV passed rank to rank back to their owners",
    "nemo_automodel.components.speculative.eagle.ring_attention._update_out_and_lse": "the ring's online-softmax merge (sigmoid form)",
    "nemo_automodel.components.speculative.eagle.ring_attention._merge_diag": "the TTT diagonals merged into the ring's out/LSE",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.RingComm": "p2p send to rank+1 / receive from rank-1 on the CP group (batch_isend_irecv)",
}
PACKED = False


def seq_multiple(cp_size: int) -> int:
    return cp_size


local_positions = contiguous_positions
trainer_shift = contiguous_shift


def attention(q, cache_k, cache_v, group, scale, cu_seqlens=None):
    """``[B, T_local, H, D]``, as the draft calls it (``cu_seqlens`` must be ``None``); CP size 1: ``one_device``."""
    assert cu_seqlens is None
    if group.size() == 1:
        return one_device(q, cache_k, cache_v, group, scale)
    return ring_attention.cached_ring_attention(q, cache_k, cache_v, group, scale)
