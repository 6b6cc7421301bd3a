"""What the GPU-only model specs share: the model-independent batch, loss and mask functions of the worked example
(``deepseek_v41``, re-exported so that every spec reads the same batches), the rank's device, and the check of a
spec's ``REQUIRES``.

Device placement: on a CUDA machine every rank process of the harness's ``nccl`` pool has called
``torch.cuda.set_device(local_rank)`` before any case (``cp_harness/ranks/worker.py``), so ``rank_device()`` is that
rank's GPU; elsewhere it is the CPU. ``build`` creates the weights on the CPU under the seed (identical on every rank
and device) and then moves the model there; ``shard`` copies the global batch to the model's device the way the
recipe does (``train_ft.py``: ``v.to(self.dist_env.device)``) before the framework's sharder sees it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .deepseek_v41 import (  # noqa: F401 - re-exported: the specs' batches are the worked example's
    IGNORE_INDEX,
    local_labels,
    loss,
    make_batch,
    num_label_tokens,
    pad_batch,
    valid_positions,
)


def rank_device() -> torch.device:
    """This rank's device: ``cuda:<current device>`` where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter."""
    return next(model.parameters()).device


def batch_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A copy of ``batch`` whose tensors live on ``device``; always fresh tensors (``copy=True``).

    The recipe's batch comes fresh from the loader every step; torch ``context_parallel`` shards its buffers in
    place (``resize_``/``copy_``) and does not restore ``input_ids`` and ``labels``, so sharding the caller's own
    tensors would change the batch the one-device reference then reads.
    """
    return {key: (value.to(device, copy=True) if isinstance(value, torch.Tensor) else value)
            for key, value in batch.items()}


def unmet_requirements(requires: dict[str, str]) -> dict[str, str]:
    """The entries of a spec's ``REQUIRES`` that this process does not meet: ``"cuda"`` when
    ``torch.cuda.is_available()`` is false, a module name when it cannot be imported (``find_spec`` is None)."""
    unmet = {}
    for key, reason in requires.items():
        if key == "cuda":
            if not torch.cuda.is_available():
                unmet[key] = reason
        elif importlib.util.find_spec(key) is None:
            unmet[key] = reason
    return unmet
