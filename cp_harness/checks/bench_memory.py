"""Benchmark check: per-rank memory of one miniature-model forward and backward.

Used by ``python -m cp_harness bench`` (``cp_harness.bench``) to show memory
per rank falling as the CP size grows; it judges nothing numerical beyond
the shape of the run (every rank owns ``S_padded / N`` tokens) and a finite
loss, so it is not part of the gate suite's properties.

Each rank builds the case's batch and parameters (as the ``model`` check
does), then runs the CP miniature model forward and backward under two
meters and returns their readings in ``info``:

- ``peak_bytes``: the largest number of bytes held at once by tensors created
  during the forward and backward (tensors that existed before, such as the
  parameters and the global batch, are not counted). It is measured with a
  ``TorchDispatchMode`` that sees every ATen operation (backward ones too,
  and the outputs of collectives) and tracks live storages with weak
  references, so it is exact at operation granularity on any device;
  scratch space inside one kernel is not seen. ``forward_peak_bytes`` is the
  same meter read at the end of the forward, ``retained_bytes`` what was
  still held after the backward (gradients, the logits the check keeps).
- ``saved_bytes``: bytes of the tensors autograd saved for the backward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once,
  tensors that existed before the forward left out): the activation memory
  that context parallelism exists to divide.
- ``cuda_peak_bytes`` (CUDA only): ``torch.cuda.max_memory_allocated`` over
  the same region.

Case keys as for ``model`` (``model``, ``batch``, ``dtype``, ``num_chunks``,
``shard_primary``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cp_harness.cases.descriptions import padded_length
from cp_harness.checks import register
from cp_harness.checks.models import cp_forward, rank_inputs
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport


class LiveTensorBytes(TorchDispatchMode):
    """Bytes held by storages that ATen operations created inside the block, and their peak.

    Before each operation the meter forgets storages that have been freed;
    after it, it adds the storages of the outputs it has not seen yet. Views
    share their base's storage and are counted once.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                known = self._live.get(ref.cdata)
                if known is not None and not known[0].expired():
                    continue
                if known is not None:
                    self.current -= known[1]
                self._live[ref.cdata] = (ref, storage.nbytes())
                self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


class SavedTensorBytes:
    """Bytes of the tensors autograd saves for the backward (each storage once; pre-existing ones left out)."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self._exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = StorageWeakRef(storage).cdata
        if key not in self._seen and key not in self._exclude:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    config, params, batch, mesh = rank_inputs(case, ctx)
    existing = list(params.values()) + [v for v in batch.values() if isinstance(v, torch.Tensor)]
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        cuda_base = torch.cuda.memory_allocated(ctx.device)
    meter = LiveTensorBytes()
    with meter, SavedTensorBytes(existing) as saved:
        out = cp_forward(case, ctx, config, params, batch, mesh)
        meter.sweep()
        forward_peak = meter.peak
        out.loss.backward()
        meter.sweep()
    info = {
        "peak_bytes": int(meter.peak),
        "forward_peak_bytes": int(forward_peak),
        "retained_bytes": int(meter.current),
        "saved_bytes": int(saved.bytes),
        "local_len": int(out.local_len),
        "cp_size": int(out.cp_size),
        "dtype": case.get("dtype", "float64"),
    }
    if cuda:
        torch.cuda.synchronize(ctx.device)
        info["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(ctx.device) - cuda_base)
    return info, {"loss": out.loss.detach().reshape(())}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    n = int(case["world_size"])
    expected_len = padded_length(int(case["batch"]["seq_len"]), n) // n
    lens = np.array([o.info["local_len"] for o in outputs], dtype=np.int64)
    report.add(compare_exact("local length per rank", lens, np.full(n, expected_len, dtype=np.int64)))
    losses = [float(o.tensors["loss"]) for o in outputs]
    report.require(all(np.isfinite(losses)), f"losses must be finite, got {losses}")
    for o in outputs:
        report.require(
            o.info["peak_bytes"] > 0 and o.info["saved_bytes"] > 0,
            f"rank {o.rank}: the memory meters saw nothing ({o.info})",
        )
    report.info["per_rank"] = [
        {
            k: o.info[k]
            for k in ("peak_bytes", "forward_peak_bytes", "retained_bytes", "saved_bytes", "cuda_peak_bytes")
            if k in o.info
        }
        for o in outputs
    ]
    return report


BENCH_MEMORY = register("bench_memory", rank=_rank, evaluate=_evaluate)
