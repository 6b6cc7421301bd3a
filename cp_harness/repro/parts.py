"""What every exported script holds, written as the functions the script holds: ``script.py`` copies their source.

Starting the ranks (``main``, ``launch``, ``rank_main``, ``leave``), reading the arrays beside the script
(``load_arrays``, ``tensor``) and comparing one tensor with what the contract expects, saying where the first
difference is (``differs``). Nothing in the harness calls them: they run inside a script, where the names
below (``WORLD``, ``ARRAYS``, ...) are its constants and ``options`` / ``run_rank`` its family's functions. They
import only the standard library, torch and numpy; the placeholders here are never written into a script.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import os
import socket
import sys
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The script's constants (placeholders: script.py writes each script's own). MESH is Any: a bool (whether the calls
# get a CP mesh) or the world mesh's dict (script.Plan.mesh); the functions that index it run only with the dict.
WORLD, RANKS, TIMEOUT, ARRAYS, SHA256 = 1, 1, 120, "", ""
MESH: Any = True


def options(parser: argparse.ArgumentParser) -> None:  # the family's (placeholder)
    raise NotImplementedError


def run_rank(rank: int, args, mesh, device) -> bool:  # the family's (placeholder)
    raise NotImplementedError


def main(argv=None) -> int:
    """Start ``RANKS`` ranks in one process group on a free port; exit 0 when every rank found what the contract
    expects, 1 otherwise (a rank that raised included)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    options(parser)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: one GPU per rank")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn", help="fork: faster")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, metavar="SECONDS",
                        help="how long a rank waits for its peers (a message to the wrong rank waits this long)")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:  # a rank that fails stops the others
        torch.multiprocessing.start_processes(rank_main, (args, port), RANKS, start_method=args.start_method)
    except (torch.multiprocessing.ProcessExitedException, torch.multiprocessing.ProcessRaisedException):
        return 1
    return 0


def rank_main(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=args.timeout))
    mesh = init_device_mesh(device.type, (WORLD,), mesh_dim_names=("cp",)) if MESH else None
    try:
        ok = torch.tensor([int(run_rank(rank, args, mesh, device))], device=device)
    except Exception:
        print(f"rank {rank} raised:\n{traceback.format_exc()}", flush=True)
        os._exit(1)  # a rank that raises is a finding: leave at once, the others are stopped
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank must be right; rank 0 says so for all, last
    dist.destroy_process_group()
    sys.exit(1 if rank == 0 and not ok.item() else 0)


def rank_main_on_world_mesh(rank: int, args, port: int) -> None:
    """One rank of the world mesh ``MESH``, built as training builds it: each CP group of ``MESH["groups"]`` (global
    ranks) runs the case on ``mesh["cp"]``, where ``rank`` is the rank in the group; the other ranks only wait."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=args.timeout))
    world = DeviceMesh(device.type, torch.tensor(MESH["ranks"]).reshape(MESH["shape"]),
                       mesh_dim_names=tuple(MESH["dims"]))
    group = next((g for g in MESH["groups"] if rank in g), None)
    try:
        ok = torch.tensor([int(run_rank(group.index(rank), args, world["cp"], device) if group else True)],
                          device=device)
    except Exception:
        print(f"rank {rank} raised:\n{traceback.format_exc()}", flush=True)
        os._exit(1)  # a rank that raises is a finding: leave at once, the others are stopped
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank must be right; rank 0 says so for all, last
    dist.destroy_process_group()
    sys.exit(1 if rank == 0 and not ok.item() else 0)


def load_arrays() -> dict:
    """The case's arrays (``ARRAYS``, beside this script), refused unless their SHA-256 is ``SHA256``."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), ARRAYS), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != SHA256:
        sys.exit(f"{ARRAYS}: its SHA-256 is not {SHA256}: not the arrays this script was written with")
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def tensor(arrays: dict, name: str, device="cpu") -> torch.Tensor:
    """Array ``name`` as a tensor in its recorded dtype (bfloat16 is stored as float32, the names listed in the
    array ``bfloat16``) and strides (a permuted view is stored in memory order, its permutation as
    ``memory_order/<name>``)."""
    value = torch.from_numpy(arrays[name].copy()).to(device)
    value = value.to(torch.bfloat16) if name in arrays.get("bfloat16", ()) else value
    order = arrays.get("memory_order/" + name)
    return value if order is None else value.permute(*np.argsort(order).tolist())


def differs(name: str, actual, expected, where, budget=None, mask=None):
    """``None`` when ``actual`` is ``expected`` (on ``mask``, broadcast over trailing dims), else how many elements
    differ and the first one: ``where(index)`` and both values. Bit for bit, or within ``budget`` (``beyond``)."""
    if actual is None:
        return f"{name}: no value (no gradient reached it)"
    a = actual.detach().cpu()
    a, e = (a.float() if a.dtype == torch.bfloat16 else a).numpy(), np.asarray(expected)
    if a.shape != e.shape or (budget is None and a.dtype != e.dtype):
        return f"{name}: {a.dtype} {list(a.shape)}, expected {e.dtype} {list(e.shape)}"
    select = np.ones(e.shape, bool) if mask is None else np.broadcast_to(
        mask.reshape(mask.shape + (1,) * (e.ndim - mask.ndim)), e.shape)
    if budget is None:
        same = (a == e) | (np.isnan(a) & np.isnan(e)) if a.dtype.kind == "f" else a == e
        bad, rule = select & ~same, "bit for bit"
    else:
        bad, rule = select & beyond(a, e, select, *budget), f"more than {budget[0]:g} ULP"
    if not bad.any():
        return None
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{name}: {int(bad.sum())} of {int(select.sum())} elements differ ({rule}); the first at index "
            f"{list(first)} ({where(first)}): got {a[first].item()!r}, expected {e[first].item()!r}")


def beyond(a, e, select, ulp, floor_fraction, eps, reference):
    """Where ``a`` is more than ``ulp`` ULPs from ``e``: ``|a - e|`` in units of ``eps x max(|e|, floor)``, ``floor``
    = ``floor_fraction`` x the larger of ``reference`` and the largest ``|e|`` compared (the harness's measure)."""
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    scale = max(float(np.abs(np.where(select, e64, 0.0)).max(initial=0.0)), reference)
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(a64 - e64) / (eps * np.maximum(np.abs(e64), max(scale * floor_fraction, 1e-300)))
    return ~(error <= ulp) & ~(np.isnan(a64) & np.isnan(e64))
