"""Which devices a rank pool may use, checked before any rank starts.

``gloo`` runs every rank on the CPU. ``nccl`` gives every rank its own GPU:
rank ``i`` of a pool uses visible device ``i`` (``LOCAL_RANK``), so a pool of
``N`` ranks needs ``N`` visible GPUs, and ``K`` pools at once (pytest-xdist
workers) need ``K * N``: each worker then sees its own slice of the devices
through ``CUDA_VISIBLE_DEVICES``. Asking for more ranks than devices fails
here, with a message that says what to change, instead of as an NCCL error
deep inside a rank.
"""

from __future__ import annotations

import os

BACKENDS = ("gloo", "nccl")


class DeviceError(RuntimeError):
    """The requested backend and number of ranks do not fit this machine."""


def visible_gpus() -> list[str]:
    """Identifiers of the visible CUDA devices (``CUDA_VISIBLE_DEVICES`` entries, else ``0..count-1``)."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        ids = [x.strip() for x in env.split(",") if x.strip()]
        return ids[:count]
    return [str(i) for i in range(count)]


def check_backend(backend: str, ranks: int, *, pools: int = 1) -> None:
    """Raise ``DeviceError`` unless ``pools`` pools of ``ranks`` ranks can run on ``backend`` here."""
    if backend not in BACKENDS:
        raise DeviceError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend != "nccl":
        return
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(
            f"backend nccl needs CUDA devices, but this PyTorch ({torch.__version__}) sees none "
            f"(torch.version.cuda={torch.version.cuda}). Install a CUDA build of PyTorch on this machine, "
            f"or use the gloo backend on CPU."
        )
    count = len(visible_gpus())
    need = ranks * pools
    if need > count:
        per = f"{ranks} ranks" + (f" x {pools} pytest-xdist workers" if pools > 1 else "")
        fix = (
            f"run fewer workers (-n {count // ranks} or no -n)"
            if pools > 1 and count >= ranks
            else f"use world sizes of at most {count} (e.g. --cp-world-sizes / --world-sizes "
            f"{','.join(str(s) for s in (1, 2, 4, 8, 16, 32) if s <= count)})"
        )
        raise DeviceError(
            f"backend nccl gives every rank its own GPU: {per} need {need} GPUs, but "
            f"{count} are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            f"{fix}."
        )


def gpu_slice(worker: int, ranks: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for pool number ``worker`` of ``ranks`` ranks: its own run of devices."""
    ids = visible_gpus()
    chosen = ids[worker * ranks : (worker + 1) * ranks]
    if len(chosen) < ranks:
        raise DeviceError(
            f"pool {worker} needs GPUs {worker * ranks}..{(worker + 1) * ranks - 1}, but only {len(ids)} are visible"
        )
    return ",".join(chosen)
