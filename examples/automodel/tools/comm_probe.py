"""Bytes each framework primitive moves against the harness' analytic minimum, counted on every c10d call.

``python -m examples.automodel.tools.comm_probe [--world-sizes 2,4,8]`` spawns the ranks itself (gloo) and prints a
Markdown table for ``docs/real_clients.md``. Per primitive: one forward and one backward on a float64 shard
``[B=2, L=4, C=8]`` (``P = 512`` bytes per rank); the halo with ``W - 1 = 2`` rows (inside the previous shard)
and ``W - 1 = 12`` rows (three shards back).

Counting (bytes a rank sends, summed over ranks; the conventions of ``cp_harness/instruments/comm_meter.py``): all-gather
``(N-1) * bytes(input)``, reduce-scatter ``(N-1) * bytes(output)``, scatter: the root sends every slice but
its own, point-to-point: what is sent, all-reduce ``(N-1) * bytes`` (every peer learns every value). The
``ring`` column counts an all-reduce as a ring algorithm moves it instead, ``2 (N-1)/N * bytes``, the least
any all-reduce can send. The cp_impl handshake (a first all-gather of at most 32 integers) is control, left out
as the meter does. ``meter`` is what ``cp_harness.instruments.comm_meter`` would count today: it wraps the ``*_single`` /
``*_tensor`` collectives, ``all_reduce``, ``broadcast`` and point-to-point, not ``all_gather`` / ``scatter`` /
``reduce_scatter`` on tensor lists. The minimum is the matching case's check's ``least_communication`` (summed over ranks).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

SHAPE = (2, 4, 8)  # [B, L, C] float64 per rank
HALO_WIDTHS = (3, 13)  # W: history 2 (< L) and 12 (3 L)
METER_SEES = {
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "all_to_all_single",
    "all_reduce",
    "broadcast",
    "batch_isend_irecv",
    "send",
    "recv",
}

_log: list[tuple[str, int, int]] | None = None  # (op, bytes sent with the meter's conventions, ring-convention bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _record(op: str, sent: int, ring: int | None = None) -> None:
    if _log is not None:
        _log.append((op, sent, sent if ring is None else ring))


def _wrap(name: str, count):
    original = getattr(dist, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        count(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(dist, name, wrapper)


def install() -> None:
    """Count every c10d entry point the primitives below call (through ``torch.distributed`` attributes)."""

    def gather_like(name):
        def count(output, input, group=None, **_):
            _record(name, (_size(group) - 1) * _nbytes(input))

        return count

    for name in ("all_gather", "all_gather_into_tensor"):
        _wrap(name, gather_like(name))

    def all_gather_single(output, input, group=None, **_):
        if input.dtype == torch.int64 and input.numel() <= 32 and not _log:
            _record("control", 0)  # cp_impl's shape handshake, the first call
        else:
            _record("all_gather_single", (_size(group) - 1) * _nbytes(input))

    _wrap("all_gather_single", all_gather_single)

    for name in ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor"):
        _wrap(
            name, lambda output, input, *a, group=None, _n=name, **k: _record(_n, (_size(group) - 1) * _nbytes(output))
        )

    def scatter(tensor, scatter_list=None, src=None, group=None, **_):
        if scatter_list:
            _record("scatter", sum(_nbytes(t) for t in scatter_list) - _nbytes(tensor))

    _wrap("scatter", scatter)

    def all_reduce(tensor, *a, group=None, **_):
        n = _size(group)
        _record("all_reduce", (n - 1) * _nbytes(tensor), round(2 * (n - 1) / n * _nbytes(tensor)))

    _wrap("all_reduce", all_reduce)

    def batch(ops):
        for op in ops:
            if getattr(op.op, "__name__", "") == "isend":
                _record("batch_isend_irecv", _nbytes(op.tensor))

    _wrap("batch_isend_irecv", batch)


def primitives(rank: int, mesh):
    """``{name: (run, minimum case)}``; ``run()`` does one forward and backward on this rank."""
    from nemo_automodel.components.distributed.blockdiag_cp.exchange import _AllGatherSeqDiff
    from nemo_automodel.components.models.deepseek_v41.cp import gather_sequence as deepseek
    from nemo_automodel.components.models.kimi_linear.cp import all_gather_sequence as kimi

    import cp_impl
    from examples.automodel.adapters import qwen3_8_flash_next_halo

    group, n = mesh.get_group(), mesh.size()
    gather_case = {
        "check": "gather_sequence",
        "world_size": n,
        "shape": list(SHAPE),
        "dtype": "float64",
        "differentiable": True,
    }

    def gather(fn):
        def run():
            x = torch.rand(SHAPE, dtype=torch.float64, requires_grad=True)
            fn(x).backward(torch.rand(SHAPE[0], n * SHAPE[1], SHAPE[2], dtype=torch.float64))

        return run

    def halo(fn, width):
        def run():
            x = torch.rand(SHAPE, dtype=torch.float64, requires_grad=True)
            out = fn(x, mesh, width)
            out.backward(torch.rand(out.shape, dtype=torch.float64))

        return run

    table = {
        "cp_impl gather_sequence (bundled)": (
            gather(lambda x: cp_impl.inkling2.gather_sequence(x, mesh, True)),
            gather_case,
        ),
        "kimi_linear all_gather_sequence": (gather(lambda x: kimi(x, group, dim=1)), gather_case),
        "deepseek_v41 gather_sequence": (gather(lambda x: deepseek(x, group)), gather_case),
        "blockdiag_cp _AllGatherSeqDiff": (gather(lambda x: _AllGatherSeqDiff.apply(x, group, 1)), gather_case),
    }
    for width in HALO_WIDTHS:
        case = {
            "check": "convolution_history",
            "world_size": n,
            "shape": list(SHAPE),
            "width": width,
            "dtype": "float64",
        }
        table[f"cp_impl convolution_history (bundled), W-1={width - 1}"] = (
            halo(cp_impl.inkling2.convolution_history, width),
            case,
        )
        table[f"qwen3_8_flash_next left halo, W-1={width - 1}"] = (
            halo(qwen3_8_flash_next_halo.convolution_history, width),
            case,
        )
    return table


def run_rank(rank: int, world: int, port: int, queue) -> None:
    global _log
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.simplefilter("ignore")  # torch.distributed.nn.functional's deprecation notice, once per call site
    from torch.distributed.device_mesh import DeviceMesh

    from cp_harness.checks import check_of
    from cp_harness.judging import comm_minimum

    dist.init_process_group("gloo", rank=rank, world_size=world)
    world_group = dist.group.WORLD
    assert world_group is not None  # the process group was just initialised
    mesh = DeviceMesh.from_group(world_group, "cpu", mesh_dim_names=("cp",))
    install()
    rows = []
    for name, (run, case) in primitives(rank, mesh).items():
        _log = []
        run()
        log, _log = _log, None
        everything: list[Any] = [None] * world
        dist.all_gather_object(everything, log)
        if rank == 0:
            calls = [c for rank_log in everything for c in rank_log if c[0] != "control"]
            moved = sum(c[1] for c in calls)
            ring = sum(c[2] for c in calls)
            meter = sum(c[1] for c in calls if c[0] in METER_SEES)
            ops = sorted({c[0] for c in calls})
            rows.append(
                (name, world, moved, ring, meter, comm_minimum.total(check_of(case).least_communication(case)), ops)
            )
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    args = parser.parse_args(argv)
    context = mp.get_context("spawn")
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = context.Queue()
        procs = [context.Process(target=run_rank, args=(r, world, port, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows += queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            print(f"a rank of the N={world} probe failed", file=sys.stderr)
            return 1
    rows.sort(key=lambda r: (r[0], r[1]))
    print("| primitive | N | c10d calls | moved / min | moved / min, all-reduce as a ring | meter sees / min |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name, world, moved, ring, meter, minimum, ops in rows:
        print(
            f"| {name} | {world} | {', '.join(ops)} | {moved / minimum:.2f} | {ring / minimum:.2f} | {meter / minimum:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
