"""Repro: nemo-automodel 0.7.0's EAGLE-3 ring backward aliases its float32 accumulators with the kernel's buffers.

Runs without the harness on two gloo ranks (self-spawning, or ``torchrun --nproc-per-node 2
eagle_ring_float32_alias.py``). Exit status 1 when the defect shows, 0 when every gradient is right (``--fixed``).

``ring_attention.ring_flash_attn_backward`` allocates ``dq_buf = torch.empty_like(q)`` (and ``dk_buf``, ``dv_buf``),
lets the kernel write each step's gradients there, and starts its float32 accumulators with
``dq = dq_buf.to(torch.float32)``. For a float32 ``q`` that ``to`` returns ``dq_buf`` itself, so the next step's
kernel call overwrites the accumulator and ``dq += dq_buf`` adds that step twice (``dk`` / ``dv`` alias the buffers
the next step writes while they are being sent). ``zigzag_ring_flash_attn_varlen_backward`` does the same
(``dq = dq_buffer.to(torch.float32)``). Latent in 0.7.0: flash-attn 2.8's kernels refuse float32, so only a kernel
that takes float32 reaches it (the harness saw it on its CPU stand-in before that refused float32 as the kernel does).

The kernel here is a stand-in that writes the number of its call into ``dq`` (1, then 2): rank 1 runs two ring
steps, so its ``dq`` must be 1 + 2 = 3; it comes out 4. ``--fixed`` runs the same calls with bfloat16 inputs,
where ``to(torch.float32)`` copies (what ``to(torch.float32, copy=True)``, the fix proposed upstream, does for every
dtype): 3.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
from _launch import command_line, leave, run

MODULE = "nemo_automodel.components.speculative.eagle.ring_attention"


def framework_ring():
    """``ring_attention`` without its package's ``__init__`` (which imports every draft model and needs
    Hugging Face ``datasets``): the three CP attention files import with torch alone."""
    import importlib.machinery
    import importlib.util
    import os

    package = MODULE.rsplit(".", 1)[0]
    if package not in sys.modules:
        parent = importlib.import_module(package.rsplit(".", 1)[0])
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        module = importlib.util.module_from_spec(spec)
        module.__path__ = [os.path.join(os.path.dirname(parent.__file__ or ""), "eagle")]
        sys.modules[package] = module
    return importlib.import_module(MODULE)


def main(rank: int, world: int, args) -> int:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ring = framework_ring()
    calls = []

    def backward(dout, q, k, v, out, lse, dq, dk, dv, *rest):
        calls.append(1)
        for buf in (dq, dk, dv):
            buf.fill_(float(len(calls)))  # this call's gradients: 1, then 2

    ring._flash_attn = types.SimpleNamespace(_flash_attn_backward=backward)
    dtype = torch.bfloat16 if args.fixed else torch.float32
    q = torch.zeros(1, 2, 1, 4, dtype=dtype)
    lse = torch.zeros(1, 1, 2)
    dq, _, _ = ring.ring_flash_attn_backward(dist.group.WORLD, q, q, q, q, q, lse, 1.0, causal=True)
    expected = float(sum(range(1, len(calls) + 1)))  # rank r runs r + 1 causal steps
    ok = bool((dq.float() == expected).all())
    print(
        f"rank {rank} ({dtype}): dq {dq.flatten()[0].item()}, expected {expected}: {'ok' if ok else 'WRONG'}",
        flush=True,
    )
    return leave(ok)


def cli(argv: list[str] | None = None) -> int:
    """The command line: exit status 1 while the defect shows, 0 when every rank is right."""
    return run(main, 2, command_line(__doc__).parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
