"""Subject: ``cached_zigzag_ring_attention`` (``components/speculative/eagle/ring_attention.py``, block 0 through
``zigzag_ring_attention.zigzag_ring_flash_attn_varlen_forward`` / ``_backward``), the EAGLE-3 draft's CP attention at
``cp_mode="ring"``, ``cp_zigzag=True``: the same call as ``eagle_ring`` on the zig-zag shard (rank ``r`` owns chunks
``r`` and ``2N-1-r`` of ``2N``). The zig-zag ring is varlen and unbatched: ``B == 1``."""

from __future__ import annotations

from examples.automodel.attention._eagle import (  # noqa: F401 - DTYPES, STANDINS, WORLD_SIZES: the subject interface
    DTYPES,
    STANDINS,
    WORLD_SIZES,
    one_device,
    ring_attention,
    zigzag_positions,
    zigzag_shift,
)

NAME = "eagle_zigzag"
FRAMEWORK_FUNCTION = "nemo_automodel.components.speculative.eagle.ring_attention.cached_zigzag_ring_attention"
# Framework callable -> what this subject's CP path does with it (the coverage table of scripts/real_clients).
COVERS: dict[str, str] = {
    "nemo_automodel.components.speculative.eagle.core._cp_shift_left_zigzag": "the trainer's TTT left shift on this layout (p2p of the shard heads), judged bit for bit",
    "nemo_automodel.components.speculative.eagle.ring_attention.cached_zigzag_ring_attention": "the draft's ring-mode CP attention with cp_zigzag=True, on the zig-zag shard",
    "nemo_automodel.components.speculative.eagle.ring_attention._CachedZigZagRingAttention": "its autograd Function: zig-zag block-0 ring, diagonal merge, hand-written backward",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.zigzag_ring_flash_attn_varlen_forward": "zig-zag ring forward: step 0 causal, earlier ranks' front halves, later ranks' K/V for the back half",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.zigzag_ring_flash_attn_varlen_backward": "zig-zag ring backward against the merged out/LSE, dK/dV halves routed back",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.get_half_index": "front / back half of the local [early | late] shard",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.get_half_lse": "back half of the merged LSE for the late-chunk blocks",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.update_out_and_lse": "the zig-zag ring's online-softmax merge",
    "nemo_automodel.components.speculative.eagle.zigzag_ring_attention.RingComm": "p2p send to rank+1 / receive from rank-1 on the CP group (batch_isend_irecv)",
    "nemo_automodel.components.speculative.eagle.ring_attention._merge_diag": "the TTT diagonals merged into the ring's out/LSE",
}
PACKED = False
BATCH_SIZES = (1,)


def seq_multiple(cp_size: int) -> int:
    return 2 * cp_size


local_positions = zigzag_positions
trainer_shift = zigzag_shift


def attention(q, cache_k, cache_v, group, scale, cu_seqlens=None):
    """``[1, T_local, H, D]`` in zig-zag order, as the draft calls it (``cu_seqlens`` must be ``None``); CP size 1: ``one_device``."""
    assert cu_seqlens is None
    if group.size() == 1:
        return one_device(q, cache_k, cache_v, group, scale)
    return ring_attention.cached_zigzag_ring_attention(q, cache_k, cache_v, group, scale)
