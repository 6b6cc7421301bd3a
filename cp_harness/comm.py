"""Counting the bytes a rank sends and receives through ``torch.distributed``.

The ranks wrap the c10d entry points once at start-up (``install``); the
implementation under test calls them through the ``torch.distributed`` module
as usual and every call is recorded while a ``recording()`` block is active.

Byte conventions (per rank, payload only, what a perfect algorithm must move):

- ``all_gather_single(out, inp)``: sends ``inp`` to each of the ``N - 1`` peers and
  receives their ``N - 1`` slices: ``sent = recv = (N - 1) * bytes(inp)``.
- ``reduce_scatter_single(out, inp)``: each peer needs its slice of ``inp`` and
  sends us ours: ``sent = recv = (N - 1) * bytes(out)``.
- ``all_to_all_single``: everything except the slice kept locally.
- ``batch_isend_irecv``/``send``/``recv``: the tensors of the send and receive operations.
- ``all_reduce(t)``: every peer must learn our value and we theirs:
  ``sent = recv = (N - 1) * bytes(t)``.
- ``broadcast``/``all_gather``/``all_gather_into_tensor`` (older names): as their
  logical data movement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator

import torch
import torch.distributed as dist


@dataclasses.dataclass
class CollectiveCall:
    """One recorded call: ``op`` name, group size, dtype, and bytes this rank sent and received."""

    op: str
    group_size: int
    dtype: str
    numel: int
    sent: int
    recv: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_calls: list[CollectiveCall] | None = None
_installed = False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _record(op: str, tensor: torch.Tensor, group, sent: int, recv: int) -> None:
    if _calls is not None:
        _calls.append(CollectiveCall(op, _group_size(group), str(tensor.dtype).removeprefix("torch."), tensor.numel(), sent, recv))


def _counting_all_gather_single(fn, output_tensor, input_tensor, group=None, async_op=False):
    n = _group_size(group)
    _record("all_gather", input_tensor, group, (n - 1) * _nbytes(input_tensor), (n - 1) * _nbytes(input_tensor))
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)


def _counting_reduce_scatter_single(fn, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n = _group_size(group)
    _record("reduce_scatter", output, group, (n - 1) * _nbytes(output), (n - 1) * _nbytes(output))
    return fn(output, input, op=op, group=group, async_op=async_op)


def _counting_all_to_all_single(fn, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    n = _group_size(group)
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    row_in = _nbytes(input) // max(input.shape[0], 1) if input.dim() else _nbytes(input)
    row_out = _nbytes(output) // max(output.shape[0], 1) if output.dim() else _nbytes(output)
    in_splits = input_split_sizes or [input.shape[0] // n] * n
    out_splits = output_split_sizes or [output.shape[0] // n] * n
    sent = sum(s for i, s in enumerate(in_splits) if i != rank) * row_in
    recv = sum(s for i, s in enumerate(out_splits) if i != rank) * row_out
    _record("all_to_all", input, group, sent, recv)
    return fn(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def _counting_all_reduce(fn, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n = _group_size(group)
    _record("all_reduce", tensor, group, (n - 1) * _nbytes(tensor), (n - 1) * _nbytes(tensor))
    return fn(tensor, op=op, group=group, async_op=async_op)


def _counting_batch_isend_irecv(fn, p2p_op_list):
    if _calls is not None:
        for p2p in p2p_op_list:
            is_send = getattr(p2p.op, "__name__", "") == "isend"
            nb = _nbytes(p2p.tensor)
            _record("isend" if is_send else "irecv", p2p.tensor, p2p.group, nb if is_send else 0, 0 if is_send else nb)
    return fn(p2p_op_list)


def _counting_p2p(op_name, fn, tensor, *args, **kwargs):
    nb = _nbytes(tensor)
    _record(op_name, tensor, kwargs.get("group"), nb if "send" in op_name else 0, nb if "recv" in op_name else 0)
    return fn(tensor, *args, **kwargs)


def _counting_broadcast(fn, tensor, *args, **kwargs):
    group = kwargs.get("group")
    n = _group_size(group)
    _record("broadcast", tensor, group, (n - 1) * _nbytes(tensor), _nbytes(tensor))
    return fn(tensor, *args, **kwargs)


_WRAPPERS = {
    "all_gather_single": _counting_all_gather_single,
    "all_gather_into_tensor": _counting_all_gather_single,
    "reduce_scatter_single": _counting_reduce_scatter_single,
    "reduce_scatter_tensor": _counting_reduce_scatter_single,
    "all_to_all_single": _counting_all_to_all_single,
    "all_reduce": _counting_all_reduce,
    "batch_isend_irecv": _counting_batch_isend_irecv,
    "broadcast": _counting_broadcast,
}


def install() -> None:
    """Wrap the ``torch.distributed`` entry points (idempotent). Calls outside ``recording()`` cost one check."""
    global _installed
    if _installed:
        return
    for name, wrapper in _WRAPPERS.items():
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, functools.wraps(original)(functools.partial(wrapper, original)))
    # isend/irecv stay unwrapped: P2POp checks its op by identity, and batch_isend_irecv
    # (wrapped above) already counts the operations it is given.
    for name in ("send", "recv"):
        original = getattr(dist, name)
        setattr(dist, name, functools.wraps(original)(functools.partial(_counting_p2p, name, original)))
    _installed = True


@contextlib.contextmanager
def recording() -> Iterator[list[CollectiveCall]]:
    """Record every collective issued inside the block into the yielded list."""
    global _calls
    previous, _calls = _calls, []
    try:
        yield _calls
    finally:
        _calls = previous


def totals(calls: list[CollectiveCall]) -> dict[str, int]:
    """``{"sent": bytes, "recv": bytes, "calls": count}`` over ``calls``."""
    return {"sent": sum(c.sent for c in calls), "recv": sum(c.recv for c in calls), "calls": len(calls)}
