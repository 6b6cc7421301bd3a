"""Standalone repros: every failing case as one script that needs torch, numpy and the code under test only.

A script starts its own ranks (``torch.multiprocessing``, gloo on a free port; ``--backend nccl`` on GPUs),
builds exactly the failing case's inputs from the ``.npz`` beside it (its SHA-256 written in the script), runs
only the calls that failed and compares what they return with what the contract expects, under the check's
budget; it prints the first failing tensor with its rank, global position and both values, and exits 1 while
the defect is there, 0 once it is fixed. Each check says what its repro runs and compares (``Check.repro``);
``CaseRunner.export_repro`` writes it (narrowing a model failure first). Modules:

* ``parts`` -- the functions every script holds (launching the ranks, reading the arrays, comparing).
* ``script`` -- the one writer: a ``Plan`` becomes ``NAME.py`` and ``NAME.npz`` (``NotExportable``: why not); a
  case on a world mesh runs its script on ``mesh["cp"]`` of the same mesh (``on_world_mesh``).
* ``subjects`` -- the code under test and how a script reaches it: an implementation module imported by name,
  or an adapter's framework function called directly, its translation copied into the script.
* ``fixes`` -- fixes proposed upstream that a script ships (``--fixed``): ``FixedGather``.
* ``calls`` -- scripts of one documented call on every rank (gathers, halos, the loss; a narrowed call).
* ``sharding`` -- scripts of a hook and its sharder: the local batch at the reported index map, the caller's
  tensors, the token verbs.
* ``real_model`` -- scripts of a real model's CP step against the same model on one device, in the script.

``RecordedCall``: a documented call recorded and replayed on the ranks (``coverage.replay``), read back here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from cp_harness.cases.descriptions import canonical, case_id
from cp_harness.repro.script import NotExportable, Plan, on_world_mesh, write
from cp_harness.repro.subjects import Subject, subject_of

__all__ = ["NotExportable", "Plan", "RecordedCall", "Request", "Subject", "on_world_mesh", "portable", "recorded_calls",
           "subject_of", "write"]


@dataclasses.dataclass
class Request:
    """What a check's ``Repro.plan`` is given: the failing ``case``, the implementation module it ran (``impl``),
    the judging ``policy``, its ``report``, and ``note``: how the case was reached (narrowed from another)."""

    case: dict
    impl: str
    policy: Any
    report: Any = None
    note: str = ""

    @property
    def name(self) -> str:
        return case_id(self.case)

    @property
    def case_text(self) -> str:
        return canonical(self.case) + f" (implementation {self.impl})" + (f"; {self.note}" if self.note else "")

    def subject(self, function: str, translate: bool = True) -> Subject:
        return subject_of(self.impl, function, translate)


def _restore(array: np.ndarray, described: dict) -> torch.Tensor:
    value = torch.from_numpy(np.asarray(array).copy()).to(getattr(torch, described["dtype"]))
    order = described.get("memory_order")
    return value if order is None else value.permute(*np.argsort(order).tolist())


@dataclasses.dataclass
class RecordedCall:
    """A documented call recorded on every rank and replayed there on its own. Per rank (rank order): ``inputs``
    (argument position -> tensor, as the call received it, strides included), ``upstream`` (the gradient that
    reached its output, ``None``: none), the replayed ``output`` and ``grads`` (argument position -> gradient);
    ``others``: the other arguments' ``repr`` by position; ``arguments``: how many it took."""

    index: int
    function: str
    arguments: int
    others: dict[str, str]
    inputs: list[dict[int, torch.Tensor]]
    upstream: list[torch.Tensor | None]
    output: list[torch.Tensor | None]
    grads: list[dict[int, torch.Tensor]]


def portable(call: RecordedCall) -> RecordedCall:
    """``call`` with its upstream gradients rounded to bfloat16's grid (dtype and strides kept), for the script it
    is exported to. They come from a model's backward, whose float64/float32 last bits differ between processors
    and kernel sets (an AMD AVX2 and an Intel AVX-512 machine gave 24 of 64 elements one ULP apart), so the script
    and its arrays would differ from one machine to the next. Only the export is rounded: whether the call is wrong
    is decided on what it received. A replayed call's defect shows in where its gradient goes, not in its last
    bits."""
    def rounded(u: torch.Tensor | None) -> torch.Tensor | None:
        if u is None or u.dtype not in (torch.float64, torch.float32):
            return u
        return u.to(torch.bfloat16).to(u.dtype)
    return dataclasses.replace(call, upstream=[rounded(u) for u in call.upstream])


def _per_rank(per_rank: list, index: int, kind: str, j: int | None = None) -> list[torch.Tensor | None]:
    """Every rank's tensor ``call{index}/{kind}{j}`` (``None`` on a rank that recorded none)."""
    key = f"call{index}/{kind}" + ("" if j is None else str(j))
    return [(_restore(t[key], d[key]) if key in d else None) for d, t in per_rank]


def recorded_calls(outputs: list) -> list[RecordedCall]:
    """The calls a ``"record_calls": true`` run recorded (``checks.run_on_rank``), every rank's side together."""
    first = outputs[0].info.get("recorded_calls", [])
    calls = []
    for i, described in enumerate(first):
        per_rank = [(o.info["recorded_calls"][i]["tensors"], o.tensors) for o in outputs]
        pick = functools.partial(_per_rank, per_rank, i)

        positions = [j for j in range(described["arguments"]) if f"call{i}/input{j}" in described["tensors"]]
        inputs = [dict(zip(positions, values)) for values in zip(*(pick("input", j) for j in positions))]
        grads = [{j: g for j, g in zip(positions, values) if g is not None}
                 for values in zip(*(pick("grad", j) for j in positions))] if positions else [{} for _ in outputs]
        calls.append(RecordedCall(i, described["function"], described["arguments"], described["others"], inputs,
                                  pick("upstream"), pick("output"), grads))
    return calls
