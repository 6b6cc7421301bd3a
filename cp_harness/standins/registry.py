"""The registry of kernel stand-ins: what one is, which exist, and entering the ones a spec declares on a rank.

A *stand-in* replaces exactly one device kernel by a CPU computation of the same contract (inputs, outputs, the
log-sum-exp convention, what the backward reuses), so that a CP path whose only device-specific part is that
kernel runs on a CPU. Every other line of the CP path (sharding, load balancing, rotation, merges, all-to-alls,
gradient routing) stays the framework's and torch's own: a stand-in registers a kernel, it never re-implements
CP. A model spec names the stand-ins it needs (``STANDINS``, ``cp_harness.usage.spec_contract``); the real-model
check enters them around the CP step of a rank whose device is the stand-in's (``entered``), never around the
one-device reference, which runs the real CPU kernel; reports name them by ``StandIn.description``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

DEVICE_WORDS = {"cpu": "CPU"}


@dataclasses.dataclass(frozen=True)
class StandIn:
    """One stand-in. ``name``: how a spec names it; ``device_type``: the device it runs on (``"cpu"``);
    ``replaces``: the device kernel it stands in for; ``role``: what that kernel is in the CP path (report
    wording); ``computes_with``: the computation that runs instead; ``meets``: the spec requirement
    (``REQUIRES`` key) it makes unnecessary on ``device_type`` (``""``: none, e.g. one that lifts a refusal of
    backward that ``FORWARD_ONLY_ON`` would otherwise declare); ``install``: a context manager entering it in
    this process (undone on exit); ``calls``: how many times its computation ran in this process so far;
    ``reference_too``: the kernel has no implementation at all on ``device_type`` (not only none the CP path can
    use), so the one-device runs compute with the stand-in as well (``entered(..., reference=True)``)."""

    name: str
    device_type: str
    replaces: str
    role: str
    computes_with: str
    meets: str
    install: Callable[[], AbstractContextManager[None]]
    calls: Callable[[], int]
    reference_too: bool = False

    @property
    def description(self) -> str:
        """The line reports print, e.g. ``CPU, stand-in: ring SDPA per-step kernel = aten._..._for_cpu``."""
        return f"{DEVICE_WORDS.get(self.device_type, self.device_type)}, stand-in: {self.role} = {self.computes_with}"


_REGISTRY: dict[str, StandIn] = {}


def register(standin: StandIn) -> StandIn:
    """Add ``standin`` under its name (a name registered twice is a programming error)."""
    if standin.name in _REGISTRY:
        raise ValueError(f"stand-in {standin.name!r} is registered twice")
    _REGISTRY[standin.name] = standin
    return standin


def known() -> dict[str, StandIn]:
    """Every registered stand-in, by name (importing ``cp_harness.standins`` registers the bundled ones)."""
    return dict(_REGISTRY)


def get(name: str) -> StandIn:
    """The stand-in ``name``; ``KeyError`` naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no stand-in {name!r}; known: {sorted(_REGISTRY)}") from None


@dataclasses.dataclass
class Entered:
    """The stand-ins ``entered`` holds: ``descriptions`` (name -> report line) and, through ``used()``, those
    whose computation actually ran inside the block (a CP size of 1 may never reach the replaced kernel)."""

    descriptions: dict[str, str]
    _before: dict[str, int]

    def used(self) -> dict[str, str]:
        """``{name: description}`` of the entered stand-ins whose computation ran since they were entered."""
        return {name: text for name, text in self.descriptions.items() if get(name).calls() > self._before[name]}


@contextlib.contextmanager
def entered(names: tuple[str, ...] | list[str], device_type: str, reference: bool = False) -> Iterator[Entered]:
    """Enter the stand-ins ``names`` that run on ``device_type`` (the others are left out: on a GPU the real
    kernel runs), in order, and leave them in reverse order; yields the ``Entered`` record. ``reference``: for a
    one-device run, so only the stand-ins whose kernel has no implementation on the device (``reference_too``)."""
    chosen = [get(name) for name in names]
    if reference:
        chosen = [standin for standin in chosen if standin.reference_too]
    with contextlib.ExitStack() as stack:
        record = Entered({}, {})
        for standin in chosen:
            if standin.device_type == device_type:
                stack.enter_context(standin.install())
                record.descriptions[standin.name] = standin.description
                record._before[standin.name] = standin.calls()
        yield record
