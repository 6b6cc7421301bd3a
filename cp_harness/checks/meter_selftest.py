"""A check of the communication meter itself: one way of communicating per case.

``case["style"]`` names one of ``STYLES``: a list-form or tensor-form
collective, point-to-point, ``torch.distributed.nn.functional`` (forward and
backward), a functional collective, a function imported by name so that no
attribute wrapper can see it, a call from another thread, and a collective
the meter has no rule for. Every rank of the case runs it on the case's CP
group with small integer-valued payloads (distinct per rank) and returns what
it received together with the value a correct exchange gives, computed in
closed form from the CP size and rank; ``evaluate`` compares the two bit for
bit, so a case passes only when the bytes really moved. What the meter
recorded comes back with every rank's output (``RankOutput.comm``); the tests
in ``tests/instruments/test_comm_meter.py`` hold the exact bytes each style must show.

Ranks ``0..N-1`` of the pool form the case's group, so group ranks and global
ranks agree.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

# Bound at import, before the worker installs the meter (``imported_by_name``).
from torch.distributed import all_gather as all_gather_imported_by_name

from cp_harness.checks import register
from cp_harness.instruments import comm_meter as comm
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport

THREAD_TIMEOUT_S = 60.0
UNKNOWN_OP = "c10d::_cp_harness_unknown_collective"
_library = None  # keeps the unknown op registered


def _base(r: int, k: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    """Rank ``r``'s payload: ``k`` integer-valued elements ``10*(r+1) + [0..k)``."""
    return torch.arange(k, dtype=dtype, device=device) + 10 * (r + 1)


def _chunks(r: int, n: int, k: int, dtype=torch.float64, device="cpu") -> list[torch.Tensor]:
    """Rank ``r``'s ``n`` slices for a reduce-scatter / all-to-all: slice ``j`` is ``_base(r, k) + 100*j``."""
    return [_base(r, k, dtype, device) + 100 * j for j in range(n)]


def _unknown_collective_op():
    """A communication op in the ``c10d`` namespace that the meter has no rule for (it all-reduces a copy).

    Defined on first use, then the meter is installed again so that it hooks the new op (as a process
    that defines operators after start-up must do, ``cp_harness.instruments.comm_meter.install``).
    """
    global _library
    if _library is None:
        library = torch.library.Library("c10d", "FRAGMENT")
        library.define("_cp_harness_unknown_collective(Tensor x, str group_name) -> Tensor")

        def kernel(x, group_name):
            out = x.clone()
            dist.all_reduce(out, group=dist.distributed_c10d._resolve_process_group(group_name))
            return out

        library.impl("_cp_harness_unknown_collective", kernel, "CompositeExplicitAutograd")
        _library = library
        comm.install()
    return torch.ops.c10d._cp_harness_unknown_collective.default


# Each style: (group, rank, size, device) -> (received, expected)
Style = Callable[[object, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]
STYLES: dict[str, Style] = {}


def style(fn: Style) -> Style:
    STYLES[fn.__name__] = fn
    return fn


@style
def all_gather(g, r, n, dev):
    out = [torch.empty(4, dtype=torch.float64, device=dev) for _ in range(n)]
    dist.all_gather(out, _base(r, 4, device=dev), group=g)
    return torch.cat(out), torch.cat([_base(i, 4, device=dev) for i in range(n)])


@style
def all_reduce(g, r, n, dev):
    t = _base(r, 5, torch.float32, dev)
    dist.all_reduce(t, group=g)
    return t, sum(_base(i, 5, torch.float32, dev) for i in range(n))


@style
def reduce_scatter(g, r, n, dev):
    out = torch.empty(3, dtype=torch.float64, device=dev)
    dist.reduce_scatter(out, _chunks(r, n, 3, device=dev), group=g)
    return out, sum(_chunks(i, n, 3, device=dev)[r] for i in range(n))


@style
def all_to_all(g, r, n, dev):
    out = [torch.empty(2, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_to_all(out, _chunks(r, n, 2, torch.int64, dev), group=g)
    return torch.cat(out), torch.cat([_chunks(i, n, 2, torch.int64, dev)[r] for i in range(n)])


def _warned(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older names are deprecated, still used
        return fn(*args, **kwargs)


@style
def all_gather_into_tensor(g, r, n, dev):
    out = torch.empty(4 * n, dtype=torch.float32, device=dev)
    _warned(dist.all_gather_into_tensor, out, _base(r, 4, torch.float32, dev), group=g)
    return out, torch.cat([_base(i, 4, torch.float32, dev) for i in range(n)])


@style
def all_gather_single(g, r, n, dev):
    out = torch.empty(4 * n, dtype=torch.float64, device=dev)
    dist.all_gather_single(out, _base(r, 4, device=dev), group=g)
    return out, torch.cat([_base(i, 4, device=dev) for i in range(n)])


@style
def reduce_scatter_tensor(g, r, n, dev):
    out = torch.empty(3, dtype=torch.float64, device=dev)
    _warned(dist.reduce_scatter_tensor, out, torch.cat(_chunks(r, n, 3, device=dev)), group=g)
    return out, sum(_chunks(i, n, 3, device=dev)[r] for i in range(n))


@style
def reduce_scatter_single(g, r, n, dev):
    out = torch.empty(3, dtype=torch.float64, device=dev)
    dist.reduce_scatter_single(out, torch.cat(_chunks(r, n, 3, device=dev)), group=g)
    return out, sum(_chunks(i, n, 3, device=dev)[r] for i in range(n))


@style
def all_to_all_single(g, r, n, dev):
    out = torch.empty(2 * n, dtype=torch.float64, device=dev)
    dist.all_to_all_single(out, torch.cat(_chunks(r, n, 2, device=dev)), group=g)
    return out, torch.cat([_chunks(i, n, 2, device=dev)[r] for i in range(n)])


@style
def all_to_all_single_uneven(g, r, n, dev):
    """Rank ``r`` sends ``j + 1`` rows of 2 int64 to rank ``j``."""

    def rows(src, dst):
        return torch.full((dst + 1, 2), 10 * (src + 1) + dst, dtype=torch.int64, device=dev)

    out = torch.empty((r + 1) * n, 2, dtype=torch.int64, device=dev)
    dist.all_to_all_single(
        out,
        torch.cat([rows(r, j) for j in range(n)]),
        output_split_sizes=[r + 1] * n,
        input_split_sizes=[j + 1 for j in range(n)],
        group=g,
    )
    return out, torch.cat([rows(i, r) for i in range(n)])


@style
def broadcast(g, r, n, dev):
    t = _base(r, 6, device=dev)
    dist.broadcast(t, src=1, group=g)
    return t, _base(1, 6, device=dev)


def _nothing(dev):
    """What a rank that receives nothing returns (for both: it has nothing to check)."""
    return torch.zeros(1, dtype=torch.float64, device=dev)


@style
def send_recv(g, r, n, dev):
    """Rank 0 sends 6 float64 to rank 1 (blocking); the other ranks take no part."""
    if r == 0:
        dist.send(_base(0, 6, device=dev), dst=1, group=g)
    elif r == 1:
        buf = torch.empty(6, dtype=torch.float64, device=dev)
        dist.recv(buf, src=0, group=g)
        return buf, _base(0, 6, device=dev)
    return _nothing(dev), _nothing(dev)


@style
def isend_irecv(g, r, n, dev):
    """Rank 0 sends 6 float64 to rank 1 (non-blocking); the other ranks take no part."""
    if r == 0:
        dist.isend(_base(0, 6, device=dev), dst=1, group=g).wait()
    elif r == 1:
        buf = torch.empty(6, dtype=torch.float64, device=dev)
        dist.irecv(buf, src=0, group=g).wait()
        return buf, _base(0, 6, device=dev)
    return _nothing(dev), _nothing(dev)


@style
def batch_isend_irecv(g, r, n, dev):
    """A ring: every rank sends 3 float64 to ``r + 1`` and receives from ``r - 1``."""
    buf = torch.empty(3, dtype=torch.float64, device=dev)
    ops = [dist.P2POp(dist.isend, _base(r, 3, device=dev), (r + 1) % n, g), dist.P2POp(dist.irecv, buf, (r - 1) % n, g)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return buf, _base((r - 1) % n, 3, device=dev)


@style
def nn_all_gather(g, r, n, dev):
    """``torch.distributed.nn.functional.all_gather`` forward and backward (slot ``i`` weighted ``i + 1``)."""
    import torch.distributed.nn.functional as dnnf

    x = _base(r, 4, device=dev).requires_grad_()
    outs = dnnf.all_gather(x, group=g)
    sum((i + 1) * o.sum() for i, o in enumerate(outs)).backward()
    received = torch.cat([torch.cat(outs).detach(), x.grad])
    # Every rank weights our slot r by r + 1; the backward sums over the n ranks.
    return received, torch.cat(
        [
            torch.cat([_base(i, 4, device=dev) for i in range(n)]),
            torch.full((4,), float(n * (r + 1)), dtype=torch.float64, device=dev),
        ]
    )


@style
def nn_all_reduce(g, r, n, dev):
    """``torch.distributed.nn.functional.all_reduce`` forward and backward."""
    import torch.distributed.nn.functional as dnnf

    x = _base(r, 3, device=dev).requires_grad_()
    y = dnnf.all_reduce(x, group=g)
    ((r + 1) * y).sum().backward()
    return (
        torch.cat([y.detach(), x.grad]),
        torch.cat(
            [
                sum(_base(i, 3, device=dev) for i in range(n)),
                torch.full((3,), float(n * (n + 1) // 2), dtype=torch.float64, device=dev),
            ]
        ),
    )


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


@style
def fc_all_gather_tensor(g, r, n, dev):
    y = _funcol().all_gather_tensor(_base(r, 4, device=dev), 0, g)
    return y * 1, torch.cat([_base(i, 4, device=dev) for i in range(n)])


@style
def fc_all_reduce(g, r, n, dev):
    y = _funcol().all_reduce(_base(r, 5, torch.float32, dev), "sum", g)
    return y * 1, sum(_base(i, 5, torch.float32, dev) for i in range(n))


@style
def fc_reduce_scatter_tensor(g, r, n, dev):
    y = _funcol().reduce_scatter_tensor(torch.cat(_chunks(r, n, 3, device=dev)), "sum", 0, g)
    return y * 1, sum(_chunks(i, n, 3, device=dev)[r] for i in range(n))


@style
def fc_all_to_all_single(g, r, n, dev):
    y = _funcol().all_to_all_single(torch.cat(_chunks(r, n, 2, device=dev)), None, None, g)
    return y * 1, torch.cat([_chunks(i, n, 2, device=dev)[r] for i in range(n)])


@style
def fc_all_gather_tensor_autograd(g, r, n, dev):
    """Forward all-gather, backward reduce-scatter (slot ``i`` weighted ``i + 1``)."""
    x = _base(r, 4, device=dev).requires_grad_()
    y = _funcol().all_gather_tensor_autograd(x, 0, g)
    weights = torch.cat([torch.full((4,), float(i + 1), dtype=torch.float64, device=dev) for i in range(n)])
    (y * weights).sum().backward()
    return (
        torch.cat([(y * 1).detach(), x.grad]),
        torch.cat(
            [
                torch.cat([_base(i, 4, device=dev) for i in range(n)]),
                torch.full((4,), float(n * (r + 1)), dtype=torch.float64, device=dev),
            ]
        ),
    )


@style
def imported_by_name(g, r, n, dev):
    """``all_gather`` through a reference bound when this module was imported, before ``comm.install()``
    (no wrapper of ``torch.distributed`` attributes could see such a call)."""
    out = [torch.empty(4, dtype=torch.float64, device=dev) for _ in range(n)]
    all_gather_imported_by_name(out, _base(r, 4, device=dev), group=g)
    return torch.cat(out), torch.cat([_base(i, 4, device=dev) for i in range(n)])


@style
def other_thread(g, r, n, dev):
    """``dist.all_reduce`` issued from a thread this rank starts (the meter's fallback)."""
    t = _base(r, 5, device=dev)
    errors: list[BaseException] = []

    def body():
        try:
            dist.all_reduce(t, group=g)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the rank's own thread
            errors.append(exc)

    thread = threading.Thread(target=body, name="comm_styles.other_thread", daemon=True)
    thread.start()
    thread.join(THREAD_TIMEOUT_S)
    if thread.is_alive():
        raise TimeoutError(f"the all_reduce thread did not finish within {THREAD_TIMEOUT_S} s")
    if errors:
        raise errors[0]
    return t, sum(_base(i, 5, device=dev) for i in range(n))


@style
def unknown_collective(g, r, n, dev):
    """An op in the ``c10d`` namespace without a byte rule; it really all-reduces."""
    y = _unknown_collective_op()(_base(r, 5, device=dev), g.group_name)
    return y, sum(_base(i, 5, device=dev) for i in range(n))


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    name = case["style"]
    if name not in STYLES:
        raise ValueError(f"unknown communication style {name!r}; known: {sorted(STYLES)}")
    if ctx.cp_size < 2:
        raise ValueError("comm_styles needs world_size >= 2")
    received, expected = STYLES[name](ctx.mesh.get_group(), ctx.rank, ctx.cp_size, ctx.device)
    info = {"rank": ctx.rank, "hooked": sorted(comm.hooked), "not_hooked": dict(comm.not_hooked)}
    return info, {"received": received.detach(), "expected": expected.detach()}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    for o in outputs:
        report.add(compare_exact(f"received@rank{o.rank}", o.tensors["received"], o.tensors["expected"], rank=o.rank))
    return report


METER_SELFTEST = register("comm_styles", rank=_rank, evaluate=_evaluate)
