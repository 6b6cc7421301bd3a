"""Model spec: torchtitan 0.3.0's llama3 (FlexAttention, document block masks) at a tiny config through its CP entry
with the trainer's default load balancer, ``"headtail"`` (``parallelism.context_parallel_load_balancer``): rank
``r`` holds chunks ``r`` and ``2N-1-r`` of ``2N``. What is called and why: ``_llama3`` and docs/torchtitan.md."""

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

NAME = "llama3_flex"
FRAMEWORK_CLASS = "torchtitan.models.llama3.model.Llama3Model"
LOAD_BALANCER = "headtail"
COVERS: dict[str, str] = {
    **_llama3.COVERS_COMMON,
    "torch.distributed.tensor.experimental._context_parallel._load_balancer._HeadTailLoadBalancer": "cp_shard's 'headtail': chunks r and 2N-1-r",
}


def shard(model: torch.nn.Module, mesh: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """``_llama3.shard_with(model, mesh, batch, "headtail")``."""
    return _llama3.shard_with(model, mesh, batch, LOAD_BALANCER)
