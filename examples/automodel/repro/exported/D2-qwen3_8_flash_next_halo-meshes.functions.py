"""Repro: nemo-automodel's nemo_automodel.components.models.qwen3_8_flash_next.cp.qwen3_8_flash_next_cp_left_halo,
serving inkling2.convolution_history as examples.automodel.adapters.qwen3_8_flash_next_halo translates it at CP size
2.

What it checks: convolution_history(x, mesh, width) returns the width - 1 global rows before this rank's shard
(zeros before position 0) followed by x; the backward adds every history row's gradient to the rank that owns the
row (bfloat16/float16: in float32, rounded once). Each of the 2 ranks holds its own inputs (x [2, 3, 2] float64 on
rank 0; drawn from the case's seed), calls inkling2.convolution_history(x, mesh, 3), backpropagates the upstream
gradient the case used and compares what it returned with what the contract expects, bit for bit (data movement);
the first difference is printed with its rank and global position.

The code under test is the framework function, called as examples.automodel.adapters.qwen3_8_flash_next_halo
translates the documented call (that translation is copied below). Run from the repository root (--backend nccl: on
GPUs):

    PYTHONPATH=. python D2-qwen3_8_flash_next_halo-meshes.functions.py                 # exit 1 while the defect is there, 0 once fixed
    PYTHONPATH=. python D2-qwen3_8_flash_next_halo-meshes.functions.py --impl cp_impl  # the bundled implementation: exit 0

The ranks form the world mesh cp x dp = 2 x 2 (DeviceMesh, mesh_dim_names ['cp', 'dp']), as training builds it; each
CP group of global ranks [[0, 2], [1, 3]] runs the case on mesh["cp"], and "rank" below is the rank in that group.

Exported by cp_harness from the case
{"check":"convolution_history","dtype":"float64","impl":"examples.automodel.adapters.qwen3_8_flash_next_halo","mesh_layout":{"dims":["cp","dp"],"shape":[2,2]},"seed":202,"shape":[2,3,2],"width":3,"world_size":2}
(implementation examples.automodel.adapters.qwen3_8_flash_next_halo).
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
from torch.distributed.device_mesh import DeviceMesh
from nemo_automodel.components.models.qwen3_8_flash_next import cp as framework

WORLD = 2
RANKS = 4
MESH = {'dims': ['cp', 'dp'], 'shape': [2, 2], 'ranks': [0, 1, 2, 3], 'groups': [[0, 2], [1, 3]]}
TIMEOUT = 120
ARRAYS = 'D2-qwen3_8_flash_next_halo-meshes.functions.npz'
SHA256 = 'b80d9a56b2e123b11673198a23c8bd0361a73522cd0d4872428af48b8ece5882'
INPUTS = ('x',)
DIFFERENTIATED = ('x',)
EXPECT = [{'name': 'output', 'axis': 1}, {'name': 'grad x', 'axis': 1}]


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


def code_under_test(args):
    """inkling2.convolution_history of the module ``args.impl``; without it, the framework's,
    as examples.automodel.adapters.qwen3_8_flash_next_halo translates it (copied below)."""
    if not args.impl:
        return convolution_history
    module = importlib.import_module(args.impl)
    part = getattr(module, 'inkling2', None) or importlib.import_module(args.impl + '.inkling2')
    return part.convolution_history


FRAMEWORK_FUNCTION = framework.qwen3_8_flash_next_cp_left_halo


def cp_group(mesh: Any):
    """The process group of a 1-D CP ``DeviceMesh``; ``None`` for ``mesh=None`` or one rank."""
    if mesh is None or mesh.size() == 1:
        return None
    return mesh.get_group()


def context_for(masked: torch.Tensor, mesh) -> framework.Qwen3_8_FlashNextCPContext:
    """The framework's CP context for this rank's ``masked [B, L, C]`` on ``mesh``."""
    group = cp_group(mesh)
    size = 1 if group is None else int(mesh.size())
    rank = 0 if group is None else int(mesh.get_local_rank())
    batch, local = int(masked.shape[0]), int(masked.shape[1])
    ids = torch.zeros(batch, size * local, dtype=torch.int64, device=masked.device)
    return framework.Qwen3_8_FlashNextCPContext(
        group=group,
        rank=rank,
        size=size,
        global_input_ids=ids,
        global_padding_mask=torch.zeros_like(ids, dtype=torch.bool),
        local_sequence_start=rank * local,
        local_sequence_length=local,
    )


def convolution_history(masked: torch.Tensor, mesh, width: int) -> torch.Tensor:
    """``[B, L, C]`` -> ``[B, L + width - 1, C]``: the framework's left halo, then ``masked``."""
    halo = FRAMEWORK_FUNCTION(masked, context_for(masked, mesh), history=width - 1)
    return torch.cat([halo, masked], dim=1)


def call(function, inputs, mesh):
    """The call that failed, as the check made it."""
    return function(inputs["x"], mesh, 3)


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
