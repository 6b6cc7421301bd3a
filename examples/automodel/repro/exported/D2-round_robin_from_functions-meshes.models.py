"""Repro: nemo-automodel's
nemo_automodel.components.distributed.context_parallel.sharder.shard_sequence_for_cp_round_robin, serving
inkling2.prepare_cp_inputs as examples.automodel.adapters.round_robin_from_functions translates it and its sharder
at CP size 2.

What it checks: shard_token_tensor(x, seq_dim=1, fill) returns this rank's positions of the index map (x padded with
fill); gather_token_tensor(local, seq_dim=1, trim) puts every rank's shard back in global order (trim: the caller's
length); the backward gives each rank's shard the sum of every rank's upstream gradient at its positions. Every rank
builds the case's global batch, calls inkling2.prepare_cp_inputs(batch), resolves the sharder it returns the
framework's way and shards inside its context, as a train step does; rank 0 judges the caller's tensors, the index
maps, the token verbs (bit for bit) and prints what differs, with the rank, the global position and both values.

The code under test is the framework function, called as examples.automodel.adapters.round_robin_from_functions
translates the documented call (that translation is copied below). Run from the repository root (--backend nccl: on
GPUs):

    PYTHONPATH=. python D2-round_robin_from_functions-meshes.models.py                 # exit 1 while the defect is there, 0 once fixed
    PYTHONPATH=. python D2-round_robin_from_functions-meshes.models.py --impl cp_impl  # the bundled implementation: exit 0

The ranks form the world mesh cp x dp = 2 x 2 (DeviceMesh, mesh_dim_names ['cp', 'dp']), as training builds it; each
CP group of global ranks [[0, 2], [1, 3]] runs the case on mesh["cp"], and "rank" below is the rank in that group.

Exported by cp_harness from the case
{"check":"sharder_roundtrip","dtype":"float64","impl":"examples.automodel.adapters.round_robin_from_functions","mesh_layout":{"dims":["cp","dp"],"shape":[2,2]},"seed":205,"shape":[2,5,3],"world_size":2}
(implementation examples.automodel.adapters.round_robin_from_functions).
"""

import argparse
import contextlib
import datetime
import functools
import hashlib
import importlib
import io
import os
import socket
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from nemo_automodel.components.distributed.context_parallel.sharder import ContextParallelSharder
from nemo_automodel.components.distributed.context_parallel.sharder import ShardLayout
from nemo_automodel.components.distributed.context_parallel.sharder import identity_local_indices
from nemo_automodel.components.distributed.context_parallel.sharder import round_robin_local_indices
from nemo_automodel.components.distributed.context_parallel.sharder import shard_sequence_for_cp_round_robin
from nemo_automodel.components.distributed.context_parallel.sharder import shard_token_tensor_by_indices

WORLD = 2
RANKS = 4
MESH = {'dims': ['cp', 'dp'], 'shape': [2, 2], 'ranks': [0, 1, 2, 3], 'groups': [[0, 2], [1, 3]]}
TIMEOUT = 120
ARRAYS = 'D2-round_robin_from_functions-meshes.models.npz'
SHA256 = '4961d727ddf8e183e72784c7b937a0103372d50ddb93ab90e7797e7d6439e366'
S = 5
HOOK = ('inkling2', 'prepare_cp_inputs', {})
BATCH_TEXT = {}
KEYS = {}
FORMS = [{'seq_dim': 1, 'fill': 0, 'trim': True}, {'seq_dim': 1, 'fill': 0, 'trim': False}]
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


def options(parser):
    parser.add_argument("--impl", metavar="MODULE",
                        help="the function of MODULE (e.g. cp_impl) instead of the framework's")


def code_under_test(args, arrays, device, marked=False):
    """``(batch, unresolved sharder)``: inkling2.prepare_cp_inputs of the module ``args.impl``; without it, the framework's sharder as examples.automodel.adapters.round_robin_from_functions builds it (copied below), on the batch as its hook leaves it."""
    if not args.impl:
        batch = global_batch(arrays, "marked_hooked" if marked else "hooked", device)
        return batch, ContextParallelSharder(shard_batch=functools.partial(_shard_batch, shard_primary=False, forget_loss_mask=False), local_token_global_indices=_local_indices)
    module = importlib.import_module(args.impl)
    part = getattr(module, 'inkling2', None) or importlib.import_module(args.impl + '.inkling2')
    batch = global_batch(arrays, "marked" if marked else "batch", device)
    return batch, getattr(part, HOOK[1])(batch, **HOOK[2])["cp_sharder"]


def _local_indices(cp_mesh, padded_seq_len: int, device=None):
    if cp_mesh is None or cp_mesh.size() <= 1:
        return identity_local_indices(cp_mesh, padded_seq_len, device)
    return round_robin_local_indices(cp_mesh, padded_seq_len, device)


def _shard_batch(
    cp_mesh,
    tp_mesh,
    batch,
    *,
    loss_mask=None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    forget_loss_mask: bool = False,
):
    del tp_mesh
    seq_len = batch["input_ids"].shape[1]
    local = {k: v for k, v in batch.items() if k != "attention_mask"}
    pads = {"labels": -100, "padding_mask": True}
    if shard_primary:
        pads["input_ids"] = padding_token_id
    padded = seq_len
    for key, fill in pads.items():
        if key in batch:
            local[key], _, padded = shard_sequence_for_cp_round_robin(cp_mesh, batch[key], pad_value=fill)
    positions = batch["position_ids"]
    if padded > seq_len:  # positions count on from each row's last slot
        more = positions[:, -1:] + torch.arange(1, padded - seq_len + 1, dtype=positions.dtype)
        positions = torch.cat([positions, more], dim=1)
    local["position_ids"] = shard_token_tensor_by_indices(positions, _local_indices(cp_mesh, padded, positions.device))
    if loss_mask is not None and not forget_loss_mask:
        local["loss_mask"], _, _ = shard_sequence_for_cp_round_robin(
            cp_mesh, loss_mask, pad_value=False if loss_mask.dtype == torch.bool else 0
        )
    return contextlib.nullcontext, local, ShardLayout(original_seq_len=seq_len, padded_seq_len=padded)


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


def run_forms(rank: int, sharder, arrays: dict, device) -> list:
    """Each token verb call of ``FORMS`` on this rank: its shard, the round trip, and the gradients (floats)."""
    out = []
    for i, form in enumerate(FORMS):
        x = tensor(arrays, f"form{i}/value", device)
        x.requires_grad_(x.is_floating_point())
        local = sharder.shard_token_tensor(x, seq_dim=form["seq_dim"], fill=form["fill"])
        back = sharder.gather_token_tensor(local, seq_dim=form["seq_dim"], trim=form["trim"], fill=form["fill"])
        result = {"local": local.detach().cpu().tolist(), "back": back.detach().cpu().tolist()}
        if x.is_floating_point():
            local.retain_grad()
            back.backward(upstream_of(i, rank, back.shape, back.dtype).to(device))
            result.update(local_grad=local.grad.cpu().tolist(), caller_grad=x.grad.cpu().tolist())
        out.append(result)
    return out


def upstream_of(i: int, rank: int, shape, dtype) -> torch.Tensor:
    """The upstream gradient of form ``i``'s round trip on ``rank``: small integers (every sum exact)."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + i)
    return torch.randint(-4, 5, tuple(shape), generator=g).to(dtype)


def form_differences(reports: list, arrays: dict) -> list:
    """Each verb call against the index map: the shard is the tensor padded with ``fill`` at the map, the round
    trip the tensor (or the padded one), each rank's gradients the sum of every rank's upstream at its positions."""
    maps, wrong = [torch.as_tensor(r["map"]) for r in reports], []
    for i, form in enumerate(FORMS):
        x, dim = torch.as_tensor(arrays[f"form{i}/value"]), form["seq_dim"]
        pad = list(x.shape)
        pad[dim] = sum(len(m) for m in maps) - x.shape[dim]
        padded = torch.cat([x, torch.full(pad, form["fill"], dtype=x.dtype)], dim)
        grad = torch.zeros_like(padded)
        if x.is_floating_point():
            out = x if form["trim"] else padded
            total = sum(upstream_of(i, r, out.shape, out.dtype) for r in range(WORLD))
            grad.narrow(dim, 0, total.shape[dim]).copy_(total)
        for r, (m, rep) in enumerate(zip(maps, reports)):
            got, own = rep["forms"][i], torch.zeros_like(grad).index_copy(dim, m, grad.index_select(dim, m))
            checks = [("shard_token_tensor", "local", padded.index_select(dim, m)),
                      ("gather_token_tensor", "back", x if form["trim"] else padded),
                      ("grad of the shard", "local_grad", grad.index_select(dim, m)),
                      ("grad of the caller's tensor", "caller_grad", own.narrow(dim, 0, x.shape[dim]))]
            wrong += [w for what, key, want in checks if key in got and (w := differs(
                f"rank {r}: form {i} {form}: {what}", torch.as_tensor(got[key], dtype=want.dtype), want.numpy(),
                lambda j: f"index {list(j)}"))]
    return wrong


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
