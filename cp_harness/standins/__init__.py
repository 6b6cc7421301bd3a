"""Kernel stand-ins: one device kernel replaced by a CPU computation of the same contract, so that a CP path
whose only device-specific part is that kernel runs, unchanged otherwise, on a CPU.

* ``registry`` -- what a stand-in is (``StandIn``: name, device, the kernel it replaces, the computation instead,
  the requirement it meets, its installer, the report line), the registry, and entering a spec's stand-ins.
* ``ring_sdpa_cpu`` -- torch ``context_parallel``'s own ring SDPA with
  ``aten._scaled_dot_product_flash_attention_for_cpu`` as its per-step op (DTensor handlers that call torch's
  ring templates; nothing of the ring re-implemented).
* ``flex_backward_cpu`` -- FlexAttention's eager (dense) path differentiated on a CPU: torch's device refusal of
  CPU backward (``flex_attention._validate_device``) replaced, nothing else.
* ``flash_attn_cpu`` -- flash-attn 2.8's four private per-block entry points (dense / varlen, forward / backward
  against the given out and LSE) as dense CPU attention, bound where the framework's EAGLE-3 CP attention binds
  flash-attn's interface module; the one-rank runs use it too.
* ``mamba_kernels_cpu`` -- mamba_ssm's / causal_conv1d's Triton and CUDA kernels (Mamba2's fused conv + SSD
  scan, the gated RMSNorm) routed to the packages' own torch references; entered around the one-device runs too.
* ``fla_conv_cpu`` / ``fla_gloo_allgather`` -- fla's convolution CP (Qwen3.5-MoE's Gated DeltaNet halo): its two
  Triton conv kernels computed by a depthwise torch conv1d of the same contract, and the NCCL branch of the
  stacked ``all_gather_into_tensor`` that gloo refuses (finding-D2 style); fla's halo exchange unchanged.
* ``glm_dsa_kernels_cpu`` -- GLM-5.2 DSA's TileLang lighting indexer and sparse MLA (forward and backward)
  computed in torch; the framework's autograd functions, wrappers and K/V all-gather unchanged; entered around the
  one-device runs too.
* ``te_thd_partition_cpu`` -- Transformer Engine's THD partition-index kernel (``thd_get_partitioned_indices``) in
  torch integer arithmetic, so the framework's TE THD batch sharding (``make_cp_batch_for_te``) runs on a CPU.
"""

from cp_harness.standins import (  # noqa: F401 - registers the bundled stand-ins
    fla_conv_cpu,
    flash_attn_cpu,
    flex_backward_cpu,
    glm_dsa_kernels_cpu,
    mamba_kernels_cpu,
    ring_sdpa_cpu,
    te_thd_partition_cpu,
)
from cp_harness.standins.registry import Entered, StandIn, entered, get, known

__all__ = ["Entered", "StandIn", "entered", "get", "known"]
