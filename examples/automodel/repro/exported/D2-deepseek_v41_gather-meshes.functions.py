"""Repro: nemo-automodel's nemo_automodel.components.models.deepseek_v41.cp.gather_sequence, serving
mistral_large4.gather_tokens as examples.automodel.adapters.deepseek_v41_gather translates it at CP size 3.

What it checks: every rank's tokens [T, ...], gathered along dim 0 in rank order, are the same global tensor on
every rank; the backward hands each rank the sum over all ranks of the upstream gradient slices of its own tokens
(bfloat16/float16: accumulated in float32, rounded once). Each of the 3 ranks holds its own inputs (value [2, 3]
bfloat16 on rank 0; drawn from the case's seed), calls mistral_large4.gather_tokens(value, mesh, True),
backpropagates the upstream gradient the case used and compares what it returned with what the contract expects, bit
for bit (data movement); the first difference is printed with its rank and global position.

The code under test is the framework function, called as examples.automodel.adapters.deepseek_v41_gather translates
the documented call (that translation is copied below). Run from the repository root (--backend nccl: on GPUs):

    PYTHONPATH=. python D2-deepseek_v41_gather-meshes.functions.py                 # exit 1 while the defect is there, 0 once fixed
    PYTHONPATH=. python D2-deepseek_v41_gather-meshes.functions.py --impl cp_impl  # the bundled implementation: exit 0
    PYTHONPATH=. python D2-deepseek_v41_gather-meshes.functions.py --fixed         # the fix proposed upstream: exit 0

The ranks form the world mesh dp_shard x cp x tp = 1 x 3 x 1 over ranks [1, 2, 3] (DeviceMesh, mesh_dim_names
['dp_shard', 'cp', 'tp']), as training builds it; each CP group of global ranks [[1, 2, 3]] runs the case on
mesh["cp"], and "rank" below is the rank in that group.

Exported by cp_harness from the case
{"check":"gather_tokens","differentiable":true,"dtype":"bfloat16","impl":"examples.automodel.adapters.deepseek_v41_gather","mesh_layout":{"dims":["dp_shard","cp","tp"],"ranks":[1,2,3],"shape":[1,3,1]},"seed":203,"shape":[2,3],"world_size":3}
(implementation examples.automodel.adapters.deepseek_v41_gather).
"""

import argparse
import contextlib
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
from torch.distributed.device_mesh import DeviceMesh
from nemo_automodel.components.models.deepseek_v41 import cp as framework

WORLD = 3
RANKS = 4
MESH = {
    'dims': ['dp_shard', 'cp', 'tp'],
    'shape': [1, 3, 1],
    'ranks': [1, 2, 3],
    'groups': [[1, 2, 3]],
}
TIMEOUT = 120
ARRAYS = 'D2-deepseek_v41_gather-meshes.functions.npz'
SHA256 = '0e182531f00128f52a2c4ed5532247aeb07586c7c06637b2994d07bbd1eb41b2'
INPUTS = ('value',)
DIFFERENTIATED = ('value',)
EXPECT = [{'name': 'output', 'axis': 0}, {'name': 'grad value', 'axis': 0}]


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
    parser.add_argument("--fixed", action="store_true",
                        help="the fix proposed upstream instead of the framework's")


def code_under_test(args):
    """mistral_large4.gather_tokens of the module ``args.impl``; without it, the framework's,
    as examples.automodel.adapters.deepseek_v41_gather translates it (copied below)."""
    if not args.impl:
        if args.fixed:
            return fixed_gather_tokens
        return gather_tokens
    module = importlib.import_module(args.impl)
    part = getattr(module, 'mistral_large4', None) or importlib.import_module(args.impl + '.mistral_large4')
    return part.gather_tokens


def cp_group(mesh: Any):
    """The process group of a 1-D CP ``DeviceMesh``; ``None`` for ``mesh=None`` or one rank."""
    if mesh is None or mesh.size() == 1:
        return None
    return mesh.get_group()


FRAMEWORK_FUNCTION = framework.gather_sequence


def autograd_if(differentiable: bool):
    """The documented ``differentiable`` flag as a context: ``False`` records no autograd history."""
    return contextlib.nullcontext() if differentiable else torch.no_grad()


def gather_tokens(value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``[T, ...]`` on every rank -> ``[N*T, ...]`` in rank order, through the framework's gather."""
    group = cp_group(mesh)
    if group is None:
        return FRAMEWORK_FUNCTION(value, None)
    with autograd_if(differentiable):
        return FRAMEWORK_FUNCTION(value.unsqueeze(0), group).squeeze(0)


class FixedGather(torch.autograd.Function):
    """``[..., L, ...]`` -> ``[..., N*L, ...]`` along ``dim`` over ``group``, with the backward proposed upstream."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        wide = torch.float32 if grad.dtype in (torch.bfloat16, torch.float16) else grad.dtype
        pieces = [p.to(wide).contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)]
        mine = torch.empty(pieces[0].shape, dtype=wide, device=grad.device)
        dist.reduce_scatter(mine, pieces, group=ctx.group)
        return mine.to(grad.dtype), None, None


def fixed_gather_tokens(value, mesh, differentiable):
    """``mistral_large4.gather_tokens`` through ``FixedGather`` (dim 0)."""
    if mesh is None or mesh.size() == 1:
        return value
    with torch.enable_grad() if differentiable else torch.no_grad():
        return FixedGather.apply(value, mesh.get_group(), 0)


def call(function, inputs, mesh):
    """The call that failed, as the check made it."""
    return function(inputs["value"], mesh, True)


def run_rank(rank: int, args, mesh, device) -> bool:
    """This rank's inputs, the call that failed, the backward with this rank's upstream gradient, then every value
    it returned against what the contract expects (``EXPECT``: bit for bit, or within a ULP budget)."""
    arrays = load_arrays()
    inputs = {name: tensor(arrays, f"rank{rank}/{name}", device).requires_grad_(name in DIFFERENTIATED)
              for name in INPUTS}
    output = call(code_under_test(args), inputs, mesh)
    if f"rank{rank}/upstream" in arrays:
        output.backward(tensor(arrays, f"rank{rank}/upstream", device))
    elif DIFFERENTIATED:
        output.backward()
    got, wrong = {"output": output, **{f"grad {name}": inputs[name].grad for name in DIFFERENTIATED}}, []
    for e in EXPECT:
        actual, positions = got[e["name"]], arrays.get(f"rank{rank}/positions/{e['name']}")
        if e.get("dtype") and actual is not None and str(actual.dtype) != e["dtype"]:
            wrong.append(f"rank {rank}: {e['name']} has dtype {actual.dtype}, the contract says {e['dtype']}")
        budget = (e["ulp"], e["floor_fraction"], ULP_EPS[e["of"]], e["reference_scale"]) if "ulp" in e else None
        wrong += [w for w in [differs(f"rank {rank}: {e['name']}", actual, arrays[f"rank{rank}/expected/{e['name']}"],
                                      lambda i: f"rank {rank}" + ("" if positions is None else
                                                                   f", global position {positions[i[e['axis']]]}"),
                                      budget)] if w]
    print("\n".join(wrong) or f"rank {rank}: every value is what the contract expects", flush=True)
    return not wrong


if __name__ == "__main__":
    sys.exit(main())
