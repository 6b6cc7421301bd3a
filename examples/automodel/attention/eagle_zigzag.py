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
)

NAME = "eagle_zigzag"
FRAMEWORK_FUNCTION = "nemo_automodel.components.speculative.eagle.ring_attention.cached_zigzag_ring_attention"
PACKED = False
BATCH_SIZES = (1,)


def seq_multiple(cp_size: int) -> int:
    return 2 * cp_size


local_positions = zigzag_positions


def attention(q, cache_k, cache_v, group, scale, cu_seqlens=None):
    """``[1, T_local, H, D]`` in zig-zag order, as the draft calls it (``cu_seqlens`` must be ``None``); CP size 1: ``one_device``."""
    assert cu_seqlens is None
    if group.size() == 1:
        return one_device(q, cache_k, cache_v, group, scale)
    return ring_attention.cached_zigzag_ring_attention(q, cache_k, cache_v, group, scale)
