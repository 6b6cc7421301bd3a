"""Which documented functions a case actually called on the implementation under test.

A verify row or a gate property that *says* it covers a function must really
call it: a row that claims ``inkling2.unpack_row_layout`` but only ever
reaches the implementation's internal copy of that logic would pass an
implementation whose ``unpack_row_layout`` is wrong. So the ranks record every
call that goes through the documented API:

- :func:`instrument` wraps an implementation's ``inkling2`` and
  ``mistral_large4`` functions (the names in ``cp_harness.cases.implementation.REQUIRED``);
  calls the implementation makes to its own functions internally are not
  counted, since they did not come through the API;
- :class:`RecordingSharder` wraps a resolved sharder: ``shard``,
  ``shard_token_tensor``, ``gather_token_tensor`` and the index map
  ``local_token_global_indices`` (named ``sharder.<verb>``);
- ``recording()`` collects the names called inside a block (one case on one
  rank), like ``cp_harness.instruments.comm_meter.recording``.

``covered(claims, called)`` says which claimed names never ran (a claim
``"inkling2.*"`` is met by any ``inkling2`` function).

Inside ``capturing()`` the same wrappers also keep what each call received: a detached copy of every tensor
argument (strides included), the other arguments as they were, and, through a hook on its output, the
upstream gradient that reached it. ``replay(captured)`` then runs every call whose result is a tensor again,
alone, on copies of those inputs with that upstream gradient, and returns what it received and returned: a
failure seen through a whole model is narrowed to the documented call that is wrong (``cp_harness.repro``).
Every rank replays the same calls in the same order, so their collectives match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cp_harness.cases.implementation import REQUIRED

SHARDER_VERBS = ("shard", "shard_token_tensor", "gather_token_tensor", "local_token_global_indices")

_called: set[str] | None = None


def note(name: str) -> None:
    """Record that the documented function ``name`` was called (no-op outside ``recording()``)."""
    if _called is not None:
        _called.add(name)


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Collect the documented functions called inside the block into the yielded set."""
    global _called
    previous, _called = _called, set()
    try:
        yield _called
    finally:
        _called = previous


@dataclasses.dataclass
class Captured:
    """One documented call inside ``capturing()``: ``function`` (``part.name``), the callable, its arguments
    (tensors detached and copied at the call, with their ``requires_grad``) and the upstream gradient that reached
    its tensor output (``None``: none did)."""

    function: str
    fn: Callable
    args: tuple
    kwargs: dict
    requires_grad: tuple[bool, ...]
    upstream: torch.Tensor | None = None


_captured: list[Captured] | None = None


@contextlib.contextmanager
def capturing() -> Iterator[list[Captured]]:
    """Keep every documented call made inside the block (what it received), in order."""
    global _captured
    previous, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = previous


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _capture(name: str, fn: Callable, args: tuple, kwargs: dict, out: Any) -> None:
    if _captured is None or not isinstance(out, torch.Tensor):
        return
    entry = Captured(
        name,
        fn,
        tuple(_copy(a) for a in args),
        {k: _copy(v) for k, v in kwargs.items()},
        tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args),
    )
    _captured.append(entry)
    if out.requires_grad:

        def keep(grad: torch.Tensor) -> None:
            entry.upstream = grad.detach().clone()  # a copy: a backward may write into the gradient it is handed

        out.register_hook(keep)


def _recorded(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        note(name)
        out = fn(*args, **kwargs)
        _capture(name, fn, args, kwargs, out)
        return out

    return call


def memory_order(value: torch.Tensor) -> list[int] | None:
    """The permutation that makes a permuted view contiguous (``None``: it is contiguous, or not a permutation of a
    dense tensor)."""
    if value.dim() < 2 or value.is_contiguous():
        return None
    strides = value.stride()
    order = sorted(range(value.dim()), key=lambda d: (-strides[d], d))
    return order if value.permute(*order).is_contiguous() else None


def _wire(tensors: dict, info: dict, name: str, value: torch.Tensor) -> None:
    """``value`` among a rank's tensors, in memory order (``info`` keeps the permutation and the dtype)."""
    order = memory_order(value)
    tensors[name] = value.permute(*order).contiguous() if order is not None else value.contiguous()
    info[name] = {"dtype": str(value.dtype).replace("torch.", ""), "memory_order": order}


def replay(captured: list[Captured]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Each captured call made again on its own: copies of its tensor inputs as leaves (requiring grad where the
    originals did), the same other arguments, then the backward of its output with the captured upstream gradient.
    ``(calls, tensors)``: per call its function and what travels under ``call{i}/...`` (``input{j}``, ``upstream``,
    ``output``, ``grad{j}``; dtypes and strides in ``calls[i]["tensors"]``)."""
    calls: list[dict] = []
    tensors: dict[str, torch.Tensor] = {}
    for i, entry in enumerate(captured):
        described: dict[str, Any] = {}
        leaves = []
        for j, (arg, grad) in enumerate(zip(entry.args, entry.requires_grad)):
            if isinstance(arg, torch.Tensor):
                leaf = arg.detach().clone().requires_grad_(grad and arg.is_floating_point())
                _wire(tensors, described, f"call{i}/input{j}", arg)
                leaves.append((j, leaf))
        by_position = dict(leaves)
        out = entry.fn(*(by_position.get(j, a) for j, a in enumerate(entry.args)), **entry.kwargs)
        _wire(tensors, described, f"call{i}/output", out.detach())
        if entry.upstream is not None and out.requires_grad:
            _wire(tensors, described, f"call{i}/upstream", entry.upstream)
            out.backward(entry.upstream)
            for j, leaf in leaves:
                if leaf.grad is not None:
                    _wire(tensors, described, f"call{i}/grad{j}", leaf.grad)
        calls.append(
            {
                "function": entry.function,
                "arguments": len(entry.args),
                "tensors": described,
                "others": {str(j): repr(a) for j, a in enumerate(entry.args) if not isinstance(a, torch.Tensor)},
            }
        )
    return calls, tensors


def instrument(impl: types.SimpleNamespace) -> types.SimpleNamespace:
    """A copy of a loaded implementation (``cp_harness.cases.implementation.load_impl``) whose documented functions record calls."""
    parts = {}
    for part, functions in REQUIRED.items():
        module = getattr(impl, part)
        members = {k: getattr(module, k) for k in dir(module) if not k.startswith("__")}
        members.update({name: _recorded(f"{part}.{name}", getattr(module, name)) for name in functions})
        parts[part] = types.SimpleNamespace(**members)
    return types.SimpleNamespace(**{**vars(impl), **parts})


class RecordingSharder:
    """A resolved sharder whose documented verbs record their calls; everything else is the sharder's own."""

    def __init__(self, sharder: Any):
        object.__setattr__(self, "_sharder", sharder)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._sharder, name)
        if name in SHARDER_VERBS and callable(value):
            return _recorded(f"sharder.{name}", value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._sharder, name, value)

    def __repr__(self) -> str:
        return f"RecordingSharder({self._sharder!r})"


def covered(claims: Iterable[str], called: Iterable[str]) -> list[str]:
    """The claims that no call met (``"part.*"`` is met by any ``part.<name>``)."""
    called = set(called)
    missing = []
    for claim in claims:
        if claim.endswith(".*"):
            if not any(name.startswith(claim[:-1]) for name in called):
                missing.append(claim)
        elif claim not in called:
            missing.append(claim)
    return missing
