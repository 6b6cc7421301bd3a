"""Model spec: ``load_balanced_sdpa`` (nemo-automodel 0.7.0's ``LlamaForCausalLM``, SDPA, the framework's
``shard_batch_load_balanced``) with torch's ``"alltoall"`` ring rotation instead of the framework's ``"allgather"``.

0.7.0 cannot select this through its recipe: ``shard_batch_load_balanced`` calls
``create_context_parallel_ctx(..., cp_rotate_method="allgather")`` ("TODO: expose through cfg"), and no config key
reaches that argument. The spec therefore enters CP exactly as ``load_balanced_sdpa`` does and then, inside
``ctx_factory()`` (after the framework's own ``set_rotate_method("allgather")``), calls torch's
``set_rotate_method("alltoall")``; the previous method is restored on exit. Torch reads the method when each ring
attention call creates its rotater, in the forward and in the backward, so the whole step uses it:
K/V travel rank to rank by ``permute_tensor`` (an all-to-all) at every ring step instead of one all-gather; dK/dV
travel by all-to-all under both methods.

What this judges: the ring a user would get once the framework exposes the rotate method, on the same model,
batches and layout. Where it runs: as ``load_balanced_sdpa`` (on a CPU with gradients on the stand-in
``ring_sdpa_cpu``; the real CUDA kernels never run, ``docs/models/gpu_only.md``).
"""

from __future__ import annotations

from . import load_balanced_sdpa as _base
from .load_balanced_sdpa import (  # noqa: F401 - the same spec interface
    BACKEND,
    BATCH_KINDS,
    CPU_ERROR,
    DTYPES,
    FRAMEWORK_CLASS,
    IGNORE_INDEX,
    REQUIRES,
    STANDINS,
    TINY,
    WORLD_SIZES,
    build,
    config,
    cp_padded_length,
    forward,
    gather_logits,
    local_labels,
    loss,
    make_batch,
    num_label_tokens,
    pad_batch,
    valid_positions,
)

NAME = "load_balanced_sdpa_alltoall"
ROTATE_METHOD = "alltoall"

COVERS: dict[str, str] = {
    **_base.COVERS,
    "torch.distributed.tensor.experimental._context_parallel._attention.set_rotate_method": "'alltoall', called by the spec after the framework's 'allgather' (not selectable in 0.7.0)",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention": "ring forward: K/V passed to the next rank by all-to-all (permute_tensor) at every step, merged by LSE",
    "torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention_backward": "ring backward: K/V and dK/dV passed rank to rank by all-to-all",
}


def shard(model, mesh, batch, padding_token_id: int = 0):
    """``load_balanced_sdpa.shard`` with torch's ``"alltoall"`` rotate method inside ``ctx_factory()``; shapes as
    there (``local_batch`` tensors ``[B, S_local]`` inside ``ctx_factory()``)."""
    return _base.shard_with_rotate_method(
        model, mesh, batch, padding_token_id=padding_token_id, rotate_method=ROTATE_METHOD
    )
