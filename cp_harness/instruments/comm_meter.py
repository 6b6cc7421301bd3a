"""Counting the bytes a rank sends and receives through ``torch.distributed``.

**How it sees the traffic.** Every collective and point-to-point call ends in
one operator of the PyTorch dispatcher, whatever Python path made it:
``c10d::*`` (``allgather_``, ``_allgather_base_``, ``allreduce_``,
``reduce_scatter_``, ``_reduce_scatter_base_``, ``alltoall_``,
``alltoall_base_``, ``broadcast_``, ``scatter_``, ``send``, ``recv_``, ...) for
the ``torch.distributed`` functions and ``ProcessGroup`` methods, and
``_c10d_functional::*`` for the functional collectives
(``torch.distributed._functional_collectives``, DTensor, compiled code).
``install()`` registers one small Python kernel on each of those operators at
the ``BackendSelect`` dispatch key (just above the CPU/CUDA kernels; no
operator of these namespaces has its own there), which records the call while
a ``recording()`` block is active and continues to the backend. So a call is
counted when made as ``dist.x``, ``torch.distributed.x``, through a function
imported by name before the meter existed, a ``ProcessGroup`` method,
``torch.distributed.nn.functional`` (forward and backward), a functional
collective (the autograd variants too), from any thread, under any
``TorchDispatchMode``. A collective is counted once, by the operator the
caller issued: an operator that runs while another is running on the same
thread (a functional collective built on a ``ProcessGroup`` method) is part of
it. Calls on ``meta`` tensors (tracing) move nothing and are not recorded.

Why not a ``TorchDispatchMode`` (as ``CommDebugMode`` does): it sees the same
operators, but every other operator of the case then goes through Python too;
measured on the standard model case that is about 10 us per operator, 6.7 ms
per case (the rank's time 2.5x). The kernels cost nothing for other operators
and tens of microseconds per collective (``docs/benchmarks.md``).

**What escapes.** An operator defined in these namespaces after ``install()``
(call it again; the worker installs after the implementation and the checks
are imported; ``hooked`` and ``not_hooked`` list what it did), methods of a
``Backend`` object (``pg._get_backend(device).allreduce``) that bypass the
dispatcher, and CUDA graph replays.

**Byte conventions** (per rank, payload only, what a perfect algorithm must
move; ``b`` = bytes of this rank's input unless said otherwise, ``N`` = group
size, ``r`` = this rank in the group):

- all-gather (every form): sends ``b`` to each of the ``N - 1`` peers and
  receives their slices: ``sent = (N - 1) * b``, ``recv`` = the other ranks'
  slices (``(N - 1) * b`` for equal slices).
- reduce-scatter (every form): each peer needs its slice of our input and
  sends us its part of ours: ``sent`` = our input except our own slice,
  ``recv = (N - 1) * bytes(output)``.
- all-reduce: every peer must learn our value and we theirs:
  ``sent = recv = (N - 1) * b``.
- all-to-all (list form and ``_single``): everything except the slice kept locally.
- broadcast: the root sends ``(N - 1) * b``, every other rank receives ``b``.
- gather / reduce: every non-root sends ``b``, the root receives ``(N - 1) * b``;
  scatter: the root sends ``(N - 1) * b``, every other rank receives ``b``.
- point-to-point: the sent or received tensor, recorded as ``isend`` /
  ``irecv`` (the dispatcher sees one ``c10d::send`` op for ``send``, ``isend``
  and ``batch_isend_irecv``; a blocking send only waits on it).
- barrier: recorded, zero bytes (it synchronises, it carries no payload).
- coalesced forms count as one call with the sum of their tensors.

The group size and this rank's place in it come from the operator's
``process_group`` argument, or its ``group_name``
(``torch.distributed.distributed_c10d._resolve_process_group``). A hooked
operator the meter has no byte rule for, or a call whose group it cannot
resolve, is recorded as **unaccounted**: ``sent`` and ``recv`` are ``None``
and ``unaccounted`` says why. Such traffic is never counted as zero bytes,
and ``cp_harness.judging.comm_minimum`` refuses to turn it into a ratio.

**Leaks.** ``recording(allowed=ranks)`` also confines the block to those global ranks (the rank's CP group):
a collective on a process group with a member outside them, or a point-to-point message to or from a peer
outside them, raises ``CommLeak`` before it reaches the backend, naming the op, the group's ranks and the
peer. On a world mesh that is the common CP bug (a collective on the default group or another dimension's
group, a peer addressed by its CP rank as if it were a global rank); raising instead of running keeps the
call from hanging or from meeting another CP group's traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cp_harness.instruments.leaks import CommLeak, UnknownGroup, leak  # noqa: F401 - CommLeak: raised here
from cp_harness.instruments.leaks import process_group as _process_group

# Namespaces whose operators communicate; every operator in them is hooked, and one without a byte rule
# is recorded as unaccounted. The legacy ``c10d_functional`` ops are left out: they decompose
# (CompositeImplicitAutograd) into ``_c10d_functional`` ops, which are counted.
HOOKED_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# Operators of those namespaces that move nothing between ranks.
_NOT_COMMUNICATION = frozenset(
    {
        "_c10d_functional::wait_tensor",
        "_c10d_functional::_wrap_tensor_autograd",
        "c10d::check_for_nan",
    }
)


@dataclasses.dataclass
class CollectiveCall:
    """One recorded communication call of one rank.

    ``op``: logical name (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``,
    ``broadcast``, ``gather``, ``scatter``, ``reduce``, ``isend``, ``irecv``, ``barrier``; for an
    unaccounted call the dispatcher op's name); ``group_size``: ranks in its process group (``None``
    when unknown); ``dtype`` and ``numel``: of the tensor the convention counts (input of a gather,
    output of a reduce-scatter, the message of a point-to-point call); ``sent`` / ``recv``: payload
    bytes this rank sent and received, ``None`` when unaccounted; ``kernel``: the dispatcher op
    (``c10d::_allgather_base_``); ``unaccounted``: why the bytes are unknown, else ``None``.
    """

    op: str
    group_size: int | None
    dtype: str
    numel: int
    sent: int | None
    recv: int | None
    kernel: str = ""
    unaccounted: str | None = None

    def as_dict(self) -> dict:
        # The fields are plain values: a shallow dict is ``dataclasses.asdict`` without its recursive copy
        # (which cost ~0.5 ms per model case on every rank).
        return {f: getattr(self, f) for f in _CALL_FIELDS}


_CALL_FIELDS = tuple(f.name for f in dataclasses.fields(CollectiveCall))
_calls: list[CollectiveCall] | None = None
_allowed: frozenset[int] | None = None  # global ranks the recorded block may reach (None: any)
_installed = False
_local = threading.local()  # .inside: a communication op is running (its inner calls are part of it)


# ------------------------------------------------------------------ byte rules
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _group(a: dict) -> tuple[int, int]:
    """``(size, rank in group)`` of the call's process group (argument ``process_group`` or ``group_name``)."""
    pg = _process_group(a)
    try:
        return int(pg.size()), int(pg.rank())
    except Exception as exc:  # noqa: BLE001 - any failure to resolve makes the call unaccounted
        raise UnknownGroup(f"{type(exc).__name__}: {exc}") from exc


# A rule maps the op's named arguments to [(op, dtype/numel tensor, numel, sent, recv), ...] and the group size.
Record = tuple[str, torch.Tensor, int, int, int]


def _others(tensors, r: int) -> int:
    return sum(_nbytes(t) for i, t in enumerate(tensors) if i != r)


def _first(tensors) -> torch.Tensor:
    return tensors[0]


def _all_gather_lists(a, n, r, outputs_key, inputs_key):
    inputs, outputs = a[inputs_key], a[outputs_key]
    sent = (n - 1) * sum(_nbytes(t) for t in inputs)
    recv = sum(_others(outs, r) for outs in outputs)
    return [("all_gather", _first(inputs), sum(t.numel() for t in inputs), sent, recv)]


def _all_gather_tensor(inp: torch.Tensor, n: int) -> list[Record]:
    return [("all_gather", inp, inp.numel(), (n - 1) * _nbytes(inp), (n - 1) * _nbytes(inp))]


def _all_gather_tensors(inputs, n: int) -> list[Record]:
    b = sum(_nbytes(t) for t in inputs)
    return [("all_gather", _first(inputs), sum(t.numel() for t in inputs), (n - 1) * b, (n - 1) * b)]


def _all_reduce(tensors, n: int) -> list[Record]:
    b = sum(_nbytes(t) for t in tensors)
    return [("all_reduce", _first(tensors), sum(t.numel() for t in tensors), (n - 1) * b, (n - 1) * b)]


def _reduce_scatter_out(outputs, n: int) -> list[Record]:
    b = sum(_nbytes(t) for t in outputs)
    return [("reduce_scatter", _first(outputs), sum(t.numel() for t in outputs), (n - 1) * b, (n - 1) * b)]


def _reduce_scatter_functional(inputs, n: int) -> list[Record]:
    # The functional forms return input / N (split along dim 0).
    b = sum(_nbytes(t) for t in inputs) // n
    return [("reduce_scatter", _first(inputs), sum(t.numel() for t in inputs) // n, (n - 1) * b, (n - 1) * b)]


def _all_to_all_single(
    inp: torch.Tensor, out_rows: int | None, out_splits, in_splits, n: int, r: int, row_out: int
) -> list[Record]:
    row_in = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else _nbytes(inp)
    in_splits = list(in_splits) if in_splits else [(inp.shape[0] if inp.dim() else 1) // n] * n
    out_splits = list(out_splits) if out_splits else ([out_rows // n] * n if out_rows is not None else in_splits)
    sent = sum(int(s) for i, s in enumerate(in_splits) if i != r) * row_in
    recv = sum(int(s) for i, s in enumerate(out_splits) if i != r) * row_out
    return [("all_to_all", inp, inp.numel(), sent, recv)]


def _rooted(op: str, tensors, n: int, r: int, root: int, *, root_sends: bool) -> list[Record]:
    b = sum(_nbytes(t) for t in tensors)
    numel = sum(t.numel() for t in tensors)
    t = _first(tensors)
    if root_sends:  # broadcast, scatter: the root's data goes out to every other rank
        return [(op, t, numel, (n - 1) * b, 0) if r == root else (op, t, numel, 0, b)]
    return [(op, t, numel, 0, (n - 1) * b) if r == root else (op, t, numel, b, 0)]  # gather, reduce


def _p2p(op: str, tensors) -> list[Record]:
    b = sum(_nbytes(t) for t in tensors)
    return [
        (op, _first(tensors), sum(t.numel() for t in tensors), b if op == "isend" else 0, b if op == "irecv" else 0)
    ]


def _row_bytes(t: torch.Tensor) -> int:
    return _nbytes(t) // max(t.shape[0], 1) if t.dim() else _nbytes(t)


def _batch_p2p(a) -> list[Record]:
    out = []
    for kind, tensor in zip(a["op_list"], a["tensors"]):
        op = "isend" if "send" in kind else "irecv"
        out += _p2p(op, [tensor])
    return out


_RULES: dict[str, Callable[[dict, int, int], list[Record]]] = {
    # torch.distributed functions and ProcessGroup methods
    "c10d::allgather_": lambda a, n, r: _all_gather_lists(a, n, r, "output_tensors", "input_tensors"),
    "c10d::allgather_coalesced_": lambda a, n, r: _all_gather_lists(a, n, r, "output_lists", "input_list"),
    "c10d::allgather_into_tensor_coalesced_": lambda a, n, r: _all_gather_tensors(a["inputs"], n),
    "c10d::_allgather_base_": lambda a, n, r: _all_gather_tensor(a["input_tensor"], n),
    "c10d::allreduce_": lambda a, n, r: _all_reduce(a["tensors"], n),
    "c10d::allreduce_coalesced_": lambda a, n, r: _all_reduce(a["tensors"], n),
    "c10d::reduce_scatter_": lambda a, n, r: [
        (
            "reduce_scatter",
            _first(a["output_tensors"]),
            sum(t.numel() for t in a["output_tensors"]),
            sum(_others(ins, r) for ins in a["input_tensors"]),
            (n - 1) * sum(_nbytes(t) for t in a["output_tensors"]),
        )
    ],
    "c10d::_reduce_scatter_base_": lambda a, n, r: _reduce_scatter_out([a["output_tensor"]], n),
    "c10d::reduce_scatter_tensor_coalesced_": lambda a, n, r: _reduce_scatter_out(a["outputs"], n),
    "c10d::alltoall_": lambda a, n, r: [
        (
            "all_to_all",
            _first(a["input_tensors"]),
            sum(t.numel() for t in a["input_tensors"]),
            _others(a["input_tensors"], r),
            _others(a["output_tensors"], r),
        )
    ],
    "c10d::alltoall_base_": lambda a, n, r: _all_to_all_single(
        a["input"],
        a["output"].shape[0] if a["output"].dim() else 1,
        a["output_split_sizes"],
        a["input_split_sizes"],
        n,
        r,
        _row_bytes(a["output"]),
    ),
    "c10d::broadcast_": lambda a, n, r: _rooted("broadcast", a["tensors"], n, r, a["root_rank"], root_sends=True),
    "c10d::scatter_": lambda a, n, r: _rooted("scatter", a["output_tensors"], n, r, a["root_rank"], root_sends=True),
    "c10d::gather_": lambda a, n, r: _rooted("gather", a["input_tensors"], n, r, a["root_rank"], root_sends=False),
    "c10d::reduce_": lambda a, n, r: _rooted("reduce", a["tensors"], n, r, a["root_rank"], root_sends=False),
    "c10d::send": lambda a, n, r: _p2p("isend", a["tensors"]),
    "c10d::recv_": lambda a, n, r: _p2p("irecv", a["tensors"]),
    "c10d::recv_any_source_": lambda a, n, r: _p2p("irecv", a["tensors"]),
    "c10d::barrier": lambda a, n, r: [("barrier", a["tensor"], 0, 0, 0)],
    "c10d::monitored_barrier_": lambda a, n, r: [("barrier", a["tensor"], 0, 0, 0)],
    # functional collectives (torch.distributed._functional_collectives, DTensor)
    "_c10d_functional::all_gather_into_tensor": lambda a, n, r: _all_gather_tensor(a["input"], n),
    "_c10d_functional::all_gather_into_tensor_out": lambda a, n, r: _all_gather_tensor(a["input"], n),
    "_c10d_functional::all_gather_into_tensor_coalesced": lambda a, n, r: _all_gather_tensors(a["inputs"], n),
    "_c10d_functional::all_reduce": lambda a, n, r: _all_reduce([a["input"]], n),
    "_c10d_functional::all_reduce_": lambda a, n, r: _all_reduce([a["input"]], n),
    "_c10d_functional::all_reduce_coalesced": lambda a, n, r: _all_reduce(a["inputs"], n),
    "_c10d_functional::all_reduce_coalesced_": lambda a, n, r: _all_reduce(a["inputs"], n),
    "_c10d_functional::reduce_scatter_tensor": lambda a, n, r: _reduce_scatter_functional([a["input"]], n),
    "_c10d_functional::reduce_scatter_tensor_out": lambda a, n, r: _reduce_scatter_functional([a["input"]], n),
    "_c10d_functional::reduce_scatter_tensor_coalesced": lambda a, n, r: _reduce_scatter_functional(a["inputs"], n),
    "_c10d_functional::all_to_all_single": lambda a, n, r: _all_to_all_single(
        a["input"], None, a["output_split_sizes"], a["input_split_sizes"], n, r, _row_bytes(a["input"])
    ),
    "_c10d_functional::broadcast": lambda a, n, r: _rooted("broadcast", [a["input"]], n, r, a["src"], root_sends=True),
    "_c10d_functional::broadcast_": lambda a, n, r: _rooted("broadcast", [a["input"]], n, r, a["src"], root_sends=True),
    "_c10d_functional::isend": lambda a, n, r: _p2p("isend", [a["tensor"]]),
    "_c10d_functional::irecv": lambda a, n, r: _p2p("irecv", [a["tensor"]]),
    "_c10d_functional::batch_p2p_ops": lambda a, n, r: _batch_p2p(a),
}
# The autograd-aware functional ops take the same arguments (seen only if their autograd kernel does not
# redispatch to the plain op first; then the plain op is not seen, so nothing is counted twice).
for _name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
    _RULES[f"_c10d_functional_autograd::{_name}"] = _RULES[f"_c10d_functional::{_name}"]


def _named_arguments(names: list[str], args, kwargs) -> dict[str, Any]:
    named = dict(zip(names, args))
    if kwargs:
        named.update(kwargs)
    return named


def _tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def account(name: str, a: dict[str, Any]) -> list[CollectiveCall]:
    """The calls one communication op ``name`` (``"c10d::allreduce_"``) with named arguments ``a`` records.

    Unaccounted (one call, ``sent = recv = None``) when there is no rule for ``name`` or its group
    size cannot be told.
    """
    rule = _RULES.get(name)
    group_size = None
    reason = None
    if rule is None:
        reason = f"no byte rule for {name}"
        with contextlib.suppress(UnknownGroup):
            group_size, _ = _group(a)
    else:
        try:
            group_size, rank = _group(a)
            records = rule(a, group_size, rank)
        except UnknownGroup as exc:
            reason = f"group size of {name} unknown ({exc})"
        except Exception as exc:  # noqa: BLE001 - arguments the rule did not expect: unknown bytes, not a crash
            reason = f"byte rule for {name} failed: {type(exc).__name__}: {exc}"
        else:
            return [
                CollectiveCall(op, group_size, _dtype(t), int(numel), int(sent), int(recv), name)
                for op, t, numel, sent, recv in records
            ]
    tensors = [t for v in a.values() for t in _tensors_in(v)]
    first = tensors[0] if tensors else None
    return [
        CollectiveCall(
            name,
            group_size,
            _dtype(first) if first is not None else "",
            first.numel() if first is not None else 0,
            None,
            None,
            name,
            reason,
        )
    ]


# ------------------------------------------------------------------ the dispatcher hook
_BELOW_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_libraries: dict[str, torch.library.Library] = {}  # keep the registrations alive
hooked: set[str] = set()  # qualified names of the hooked operators ("c10d::allreduce_")
not_hooked: dict[str, str] = {}  # operators of those namespaces left alone, and why


def _operator(qualified: str):
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def _on_meta(a: dict[str, Any]) -> bool:
    """A call on meta tensors (shape propagation while tracing) moves nothing."""
    for value in a.values():
        tensors = _tensors_in(value)
        if tensors:
            return tensors[0].device.type == "meta"
    return False


def _kernel(name: str, op, arg_names: list[str], keyset, *args, **kwargs):
    """Runs for every call of a hooked operator (at ``BackendSelect``, just above the backend): record, then
    continue to the backend's kernel."""
    below = keyset & _BELOW_BACKEND_SELECT
    calls = _calls
    if calls is None or getattr(_local, "inside", False):
        return op.redispatch(below, *args, **kwargs)
    named = _named_arguments(arg_names, args, kwargs)
    if not _on_meta(named):
        calls.extend(account(name, named))
        found = leak(name, named, _allowed) if _allowed is not None else None
        if found is not None:
            raise CommLeak(f"communication leak: {found}")
    # A collective may be built on another one (a functional collective on a ProcessGroup method): the
    # inner op is part of the outer call, not a second collective.
    _local.inside = True
    try:
        return op.redispatch(below, *args, **kwargs)
    finally:
        _local.inside = False


def install() -> None:
    """Hook every communication operator registered in this process so far (idempotent).

    Call it again after code that defines new operators in those namespaces has been imported; the
    worker installs after the implementation and the checks are loaded. Outside ``recording()`` a
    hooked call costs one check; other operators cost nothing.
    """
    global _installed
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        namespace = qualified.partition("::")[0]
        if namespace not in HOOKED_NAMESPACES or qualified in hooked or qualified in not_hooked:
            continue
        if qualified in _NOT_COMMUNICATION:
            not_hooked[qualified] = "moves nothing between ranks"
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
            not_hooked[qualified] = "decomposes into other operators, which are counted"
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "BackendSelect"):
            not_hooked[qualified] = "already has a BackendSelect kernel: NOT COUNTED"
            continue
        library = _libraries.get(namespace)
        if library is None:
            library = _libraries[namespace] = torch.library.Library(namespace, "IMPL")
        op = _operator(qualified)
        kernel = functools.partial(_kernel, qualified, op, [arg.name for arg in op._schema.arguments])
        library.impl(qualified.partition("::")[2], kernel, "BackendSelect", with_keyset=True)
        hooked.add(qualified)
    _installed = True


@contextlib.contextmanager
def recording(allowed=None) -> Iterator[list[CollectiveCall]]:
    """Record every communication call this process issues inside the block into the yielded list.

    The hooks are process-wide: calls from any thread (autograd's backward threads, threads the
    caller starts) are recorded. A nested block records into its own list only. ``allowed``: the global
    ranks the block may reach (the rank's CP group); a call that would reach another raises ``CommLeak``.
    """
    global _calls, _allowed
    if not _installed:
        install()
    previous, _calls = _calls, []
    outer, _allowed = _allowed, (frozenset(int(r) for r in allowed) if allowed is not None else _allowed)
    try:
        yield _calls
    finally:
        _calls, _allowed = previous, outer


def unaccounted(calls: list[CollectiveCall] | list[dict]) -> list[str]:
    """Sorted names of the ops among ``calls`` whose bytes are unknown."""
    ops = {
        (c["op"] if isinstance(c, dict) else c.op)
        for c in calls
        if (c.get("unaccounted") if isinstance(c, dict) else c.unaccounted)
    }
    return sorted(ops)


def totals(calls: list[CollectiveCall]) -> dict[str, int]:
    """``{"sent": bytes, "recv": bytes, "calls": count}`` over ``calls`` (``ValueError`` if some are unaccounted)."""
    missing = unaccounted(calls)
    if missing:
        raise ValueError(f"unaccounted communication: {', '.join(missing)}")
    sent = recv = 0
    for c in calls:
        assert c.sent is not None and c.recv is not None  # only an unaccounted call (raised above) has no bytes
        sent, recv = sent + c.sent, recv + c.recv
    return {"sent": sent, "recv": recv, "calls": len(calls)}
