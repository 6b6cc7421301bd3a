"""Model spec: torchtitan 0.3.0's llama3 (FlexAttention, document block masks) at a tiny config through its CP entry
with the load balancer torchtitan offers for FlexAttention, ``"ptrr"`` (``parallelism.context_parallel_load_balancer``):
torch's ``_PTRRLoadBalancer`` built from the block mask (each mask block row's cost, blocks dealt to ranks in
process-time round robin). What is called and why: ``_llama3`` and docs/torchtitan.md."""

from __future__ import annotations

from typing import Any

import torch

from . import _llama3
from ._llama3 import *  # noqa: F403 - part of the spec interface
from ._llama3 import (  # noqa: F401 - the spec interface
    BATCH_KINDS,
    DTYPES,
    STANDINS,
    WORLD_SIZES,
    build,
    cp_padded_length,
    forward,
    gather_logits,
    local_labels,
    loss,
    make_batch,
    num_label_tokens,
    valid_positions,
)

NAME = "llama3_flex_ptrr"
FRAMEWORK_CLASS = "torchtitan.models.llama3.model.Llama3Model"
LOAD_BALANCER = "ptrr"
COVERS: dict[str, str] = {
    **_llama3.COVERS_COMMON,
    "torch.distributed.tensor.experimental._context_parallel._load_balancer._PTRRLoadBalancer": "cp_shard's 'ptrr': mask block rows dealt by cost",
}


def shard(model: torch.nn.Module, mesh: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """``_llama3.shard_with(model, mesh, batch, "ptrr")``."""
    return _llama3.shard_with(model, mesh, batch, LOAD_BALANCER)
