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
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterable, Iterator

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


def _recorded(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        note(name)
        return fn(*args, **kwargs)
    return call


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
