"""The ranks of the ring SDPA stand-in test (``test_ring_sdpa_cpu.py``): this process imports torch once, then
forks every rank of every CP size in ``--worlds`` (gloo, one process group per size), as the harness's launcher
does; it exits non-zero (after ending the others) when a rank fails.

Per variant (dtype, causal, heads, length): float64 math references on the whole sequence (output, natural-log
LSE, dQ/dK/dV of ``sum(out * grad_out)``) and the one-device CPU flash kernel in the variant's dtype (its own
rounding: the baseline), all computed on every rank from the same seed; then, under the stand-in, torch's
``context_parallel`` shards Q, K, V, the upstream gradient and every reference by its own load balancer, SDPA runs
torch's ring with the CPU op, and the LSE comes from the op called on the ``Shard(2)`` DTensors. Each rank measures
``max |x - ref64| / max |ref64|`` over its shard (CP and one-device); rank 0 writes the maxima over the ranks as
JSON to ``<--out-dir>/<world>.json``. A variant with ``"convert_to_f32": false`` runs with torch's
``_cp_options.convert_to_f32`` off (torch's merge then works in the inputs' dtype).
"""

from __future__ import annotations

import datetime
import json
import sys

import forked_worlds  # the launcher beside this script (sys.path[0] when run as a script)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
from torch.nn.attention import SDPBackend, sdpa_kernel

from cp_harness import standins
from cp_harness.standins import ring_sdpa_cpu

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def references(q, k, v, grad_out, causal: bool, gqa: bool) -> dict[str, torch.Tensor]:
    """Float64 math SDPA on the whole sequence: output, natural-log LSE [B, H, S], dQ, dK, dV."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.double())
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return {"out": out.detach(), "lse": torch.logsumexp(scores, dim=-1).detach(), "dq": dq, "dk": dk, "dv": dv}


def one_device(q, k, v, grad_out, causal: bool, gqa: bool) -> dict[str, torch.Tensor]:
    """The CPU flash kernel on the whole sequence in the variant's dtype (what the ring's per-step kernel is)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    if gqa:  # the kernel op itself, for its LSE (F.sdpa does not return it); GQA through the op: K/V repeated
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    _, lse = ring_sdpa_cpu.FORWARD(q.detach(), k.detach(), v.detach(), 0.0, causal)
    return {"out": out.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def refusal(mesh, variant: dict) -> dict:
    """What the stand-in raises on inputs it must not take: ``"placement"`` (K replicated, not ``Shard(2)``) or
    ``"uneven"`` (a global sequence that is not the local one times the CP size)."""
    from torch.distributed.tensor import Replicate

    n = mesh.size()
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    if variant["refusal"] == "placement":
        args = [DTensor.from_local(q, mesh, [Shard(2)], run_check=False),
                DTensor.from_local(k, mesh, [Replicate()], run_check=False),
                DTensor.from_local(v, mesh, [Shard(2)], run_check=False)]
    else:
        shape, stride = torch.Size([1, 2, 4 * n + 1, 8]), (8 * (4 * n + 1), 8 * (4 * n + 1) // 2, 8, 1)
        args = [DTensor.from_local(t, mesh, [Shard(2)], run_check=False, shape=shape, stride=stride) for t in (q, k, v)]
    try:
        buffer = torch.zeros(1, 1, 2 * n)  # context_parallel needs one buffer to shard
        with standins.entered(("ring_sdpa_cpu",), "cpu"), context_parallel(mesh, buffers=[buffer],
                                                                            buffer_seq_dims=[2]):
            ring_sdpa_cpu.FORWARD(*args, 0.0, True)
    except NotImplementedError as exc:
        return {"variant": variant, "error": str(exc)}
    return {"variant": variant, "error": None}


def run_variant(mesh, variant: dict) -> dict:
    if "refusal" in variant:
        return refusal(mesh, variant)
    dtype, causal = DTYPES[variant["dtype"]], variant["causal"]
    heads, kv_heads, seq, dim = variant["heads"], variant["kv_heads"], variant["seq"], 8
    gqa = heads != kv_heads
    generator = torch.Generator().manual_seed(variant["seed"])
    q, k, v = (torch.randn(2, h, seq, dim, generator=generator, dtype=torch.float64).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(2, heads, seq, dim, generator=generator, dtype=torch.float64).to(dtype)
    ref = references(q, k, v, grad_out, causal, gqa)
    one = one_device(q, k, v, grad_out, causal, gqa)
    names = ["q", "k", "v", "grad_out"] + [f"ref_{n}" for n in QUANTITIES] + [f"one_{n}" for n in QUANTITIES]
    buffers = [q, k, v, grad_out] + [ref[n] for n in QUANTITIES] + [one[n] for n in QUANTITIES]
    buffers = [b.clone().contiguous() for b in buffers]
    dims = [2] * len(buffers)
    previous = torch_cp._cp_options.enable_load_balance, torch_cp._cp_options.convert_to_f32
    torch_cp._cp_options.enable_load_balance = causal  # torch's load balancer requires causal attention
    torch_cp._cp_options.convert_to_f32 = variant.get("convert_to_f32", True)
    try:
        with standins.entered(("ring_sdpa_cpu",), "cpu") as record, context_parallel(mesh, buffers=buffers,
                                                                                      buffer_seq_dims=dims):
            local = dict(zip(names, buffers))
            lq, lk, lv = (local[n].detach().clone().requires_grad_() for n in "qkv")
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa)
            dq, dk, dv = torch.autograd.grad(out, (lq, lk, lv), local["grad_out"])
            group = heads // kv_heads
            dk_in, dv_in = ((t.repeat_interleave(group, dim=1) if gqa else t) for t in (lk.detach(), lv.detach()))
            as_dtensor = [DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (lq.detach(), dk_in, dv_in)]
            _, lse = ring_sdpa_cpu.FORWARD(*as_dtensor, 0.0, causal)
            cp = {"out": out.detach(), "lse": lse.to_local(), "dq": dq, "dk": dk, "dv": dv}
            errors = torch.tensor([[relative(cp[n], local[f"ref_{n}"]) for n in QUANTITIES],
                                   [relative(local[f"one_{n}"], local[f"ref_{n}"]) for n in QUANTITIES]],
                                  dtype=torch.float64)
    finally:
        torch_cp._cp_options.enable_load_balance, torch_cp._cp_options.convert_to_f32 = previous
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return {"variant": variant, "cp": dict(zip(QUANTITIES, errors[0].tolist())),
            "one_device": dict(zip(QUANTITIES, errors[1].tolist())),
            "handlers_after": sorted(map(str, ring_sdpa_cpu.handlers())), "used": sorted(record.used())}


def rank_main(variants: list[dict], out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    results = [run_variant(mesh, v) for v in variants]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(forked_worlds.main(rank_main))
