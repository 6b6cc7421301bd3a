"""Repro: nemo-automodel's nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_aux_only, serving
inkling2.prepare_cp_inputs as examples.automodel.adapters.shard_batch_aux_only translates it and its sharder at CP
size 3.

What it checks: after shard(batch) the sharder's verbs take tensors in the caller's coordinates:
shard_token_tensor(x, seq_dim, fill) pads x with fill to the padded length and returns this rank's positions of the
index map; gather_token_tensor(local, seq_dim, trim, fill) is its inverse (trim: back to the caller's length); the
backward returns each rank's gradient at its own positions; shard() leaves the caller's tensors as they were. Every
rank builds the case's global batch, calls inkling2.prepare_cp_inputs(batch), resolves the sharder it returns the
framework's way and shards inside its context, as a train step does; rank 0 judges the caller's tensors, the index
maps (bit for bit) and prints what differs, with the rank, the global position and both values.

The code under test is the framework function, called as examples.automodel.adapters.shard_batch_aux_only translates
the documented call (that translation is copied below). Run from the repository root (--backend nccl: on GPUs):

    PYTHONPATH=. python S2-shard_batch_aux_only-sharder_verbs.py                 # exit 1 while the defect is there, 0 once fixed
    PYTHONPATH=. python S2-shard_batch_aux_only-sharder_verbs.py --impl cp_impl  # the bundled implementation: exit 0

Exported by cp_harness from the case
{"check":"sharder_verbs","dtype":"float64","forms":[{"coords":"caller","fill":0,"lead":[],"trail":[],"trim":false}],"impl":"examples.automodel.adapters.shard_batch_aux_only","layout":"strategy","model":"inkling2","rows":1,"seed":0,"seq_len":6,"world_size":3}
(implementation examples.automodel.adapters.shard_batch_aux_only).
"""

import argparse
import datetime
import hashlib
import importlib
import io
import os
import socket
import sys
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from nemo_automodel.components.distributed.context_parallel.sharder import ContextParallelSharder
from nemo_automodel.components.distributed.context_parallel.sharder import identity_local_indices
from nemo_automodel.components.distributed.context_parallel.sharder import round_robin_local_indices
from nemo_automodel.components.distributed.context_parallel.sharder import shard_batch_aux_only
from nemo_automodel.components.distributed.context_parallel.sharder import shard_batch_identity
from nemo_automodel.components.distributed.context_parallel.sharder import shard_sequence_for_cp_round_robin

WORLD = 3
RANKS = 3
MESH = True
TIMEOUT = 120
ARRAYS = 'S2-shard_batch_aux_only-sharder_verbs.npz'
SHA256 = '86f89c19534d5af3a4d3d4cc8e16db42a02f3ffd4ad3e3477dc87b01148c6ea2'
S = 6
HOOK = ('inkling2', 'prepare_cp_inputs', {})
BATCH_TEXT = {}
KEYS = {}
FORMS = []
UNPACK = False


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


def options(parser):
    parser.add_argument("--impl", metavar="MODULE",
                        help="the function of MODULE (e.g. cp_impl) instead of the framework's")


def code_under_test(args, arrays, device, marked=False):
    """``(batch, unresolved sharder)``: inkling2.prepare_cp_inputs of the module ``args.impl``; without it, the framework's sharder as examples.automodel.adapters.shard_batch_aux_only builds it (copied below), on the batch as its hook leaves it."""
    if not args.impl:
        batch = global_batch(arrays, "marked_hooked" if marked else "hooked", device)
        return batch, AuxOnlySharder(shard_batch=_shard_batch, local_token_global_indices=_local_indices)
    module = importlib.import_module(args.impl)
    part = getattr(module, 'inkling2', None) or importlib.import_module(args.impl + '.inkling2')
    batch = global_batch(arrays, "marked" if marked else "batch", device)
    return batch, getattr(part, HOOK[1])(batch, **HOOK[2])["cp_sharder"]


def _active(cp_mesh) -> bool:
    return cp_mesh is not None and cp_mesh.size() > 1


class AuxOnlySharder(ContextParallelSharder):
    """The framework's sharder; its primary-stream shard is the model side's ``shard_sequence_for_cp_round_robin``."""

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        layout = self.shard_layout
        if (
            _active(self._cp_mesh)
            and fill is not None
            and layout is not None
            and layout.original_seq_len is not None
            and tensor.shape[seq_dim] == layout.original_seq_len
        ):
            local, _, _ = shard_sequence_for_cp_round_robin(self._cp_mesh, tensor, seq_dim=seq_dim, pad_value=fill)
            return local
        return super().shard_token_tensor(tensor, seq_dim=seq_dim, fill=fill)


def _shard_batch(cp_mesh, tp_mesh, batch, **kwargs: Any):
    """``shard_batch_aux_only``, or the framework's identity sharder without an active CP mesh."""
    if not _active(cp_mesh):
        return shard_batch_identity(cp_mesh, tp_mesh, batch, **kwargs)
    return shard_batch_aux_only(cp_mesh, tp_mesh, batch, **kwargs)


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    """``round_robin_local_indices``, or the identity map without an active CP mesh."""
    if not _active(cp_mesh):
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return round_robin_local_indices(cp_mesh, padded_seq_len, device)


def global_batch(arrays: dict, prefix: str, device) -> dict:
    """The global batch stored under ``prefix/`` (a list's items under ``prefix/<key>/<i>``), on ``device``."""
    batch, lists = dict(BATCH_TEXT), {}
    for name in arrays:
        if name.startswith(prefix + "/"):
            key, _, item = name[len(prefix) + 1:].partition("/")
            if item:
                lists.setdefault(key, {})[int(item)] = tensor(arrays, name, device)
            else:
                batch[key] = tensor(arrays, name, device)
    return {**batch, **{key: [items[i] for i in sorted(items)] for key, items in lists.items()}}


def shard(rank: int, args, mesh, device, arrays: dict, marked: bool = False) -> dict:
    """Shard the case's batch with the code under test inside the sharder's context, as a train step does: what
    this rank holds, the index map it reports, what ``shard_token_tensor`` cuts, the caller's tensors it changed
    (``marked``: the batch whose labels are ``arange(S)``, to see where each rank's tokens come from)."""
    batch, sharder = code_under_test(args, arrays, device, marked)
    loss_mask = tensor(arrays, "loss_mask", device) if "loss_mask" in arrays else None
    caller = {k: (v, v.clone()) for k, v in [*batch.items(), ("loss_mask", loss_mask)] if isinstance(v, torch.Tensor)}
    sharder = type(sharder)(device_mesh=mesh, shard_batch=sharder.shard_batch, padding_token_id=0, loss_mask=loss_mask,
                            local_token_global_indices=sharder.local_token_global_indices)  # the framework's resolution
    ctx_factory, local = sharder.shard(batch)
    with ctx_factory():
        held = {k: (local[k].tolist(), str(local[k].dtype)) for k in [*KEYS, "labels"]
                if isinstance(local.get(k), torch.Tensor)}
        layout = getattr(sharder, "shard_layout", None)
        index_map = getattr(layout, "local_token_global_indices", None)
        if index_map is None:
            padded = getattr(layout, "padded_seq_len", None) or WORLD * local["labels"].shape[1]
            index_map = sharder.local_token_global_indices(mesh, padded, device)
        marker = sharder.shard_token_tensor(torch.arange(S, device=device)[None], seq_dim=1, fill=-1)[0]
        forms = run_forms(rank, sharder, arrays, device) if FORMS else []
    changed = [f"{k} from {list(saved.shape)} to {list(v.shape)}" if v.shape != saved.shape else f"{k} (overwritten)"
               for k, (v, saved) in caller.items() if v.shape != saved.shape or not torch.equal(v, saved)]
    report = {"held": held, "map": index_map.reshape(-1).tolist(), "marker": marker.tolist(), "forms": forms,
              "changed": changed}
    if KEYS and not marked:
        report["follows"] = shard(rank, args, mesh, device, arrays, marked=True)["held"]["labels"][0][0]
    return report


def judge(reports: list, arrays: dict) -> list:
    """What is wrong in the ranks' reports: the caller's tensors, the index maps, each judged key."""
    wrong = [f"rank {r}: shard() changed the caller's {change} in place (a sharder must leave the caller's tensors "
             "unchanged)" for r, rep in enumerate(reports) for change in rep["changed"]]
    maps = [np.asarray(rep["map"], dtype=np.int64) for rep in reports]
    padded = sum(len(m) for m in maps)
    if not (np.array_equal(np.sort(np.concatenate(maps)), np.arange(padded)) and padded >= S
            and len({len(m) for m in maps}) == 1):
        return wrong + [f"the index maps {[m.tolist() for m in maps]} do not own every position of [0, {padded}) "
                        f"exactly once, in equal shards"]
    for r, (m, rep) in enumerate(zip(maps, reports)):
        if rep["marker"] != np.where(m < S, m, -1).tolist():
            wrong.append(f"rank {r}: its index map is {m.tolist()}, but shard_token_tensor(arange(S)) cuts "
                         f"{rep['marker']} (-1: padding)")
    return wrong + (judge_keys(reports, arrays, maps, bool(wrong)) if KEYS else [])


def run_rank(rank: int, args, mesh, device) -> bool:
    """This rank shards the batch with the code under test and reports what it holds; rank 0 judges them all."""
    arrays = load_arrays()
    report = shard(rank, args, mesh, device, arrays)
    wrong = unpack(args, arrays, device) if UNPACK and rank == 0 else []
    reports = [report] if WORLD == 1 else [None] * WORLD
    if WORLD > 1:
        dist.all_gather_object(reports, report, group=mesh.get_group() if mesh is not None else None)  # plain data
    if rank == 0:
        wrong += judge(reports, arrays)
        wrong += form_differences(reports, arrays) if FORMS and not wrong else []
        print("\n".join(wrong) or "every rank holds what the contract expects", flush=True)
    return not wrong


if __name__ == "__main__":
    sys.exit(main())
