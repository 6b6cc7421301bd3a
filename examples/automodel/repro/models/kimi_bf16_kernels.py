"""Kimi Linear / Kimi K3 in bfloat16 on ONE process: the CP path's attention kernel alone moves the logits by as
much as CP does (nemo-automodel 0.7.0, CPU, no ranks, no harness).

On one device each MLA layer computes attention as matmul + additive mask + float32 softmax (rounded to
bfloat16) + matmul; under CP it computes it by FlexAttention (``cp.document_causal_flex_attention``). The spec's
``cp_kernels(model)`` makes the one-device forward use the CP kernel (the framework's own
``KimiMLAAttention._forward_with_cp`` over a world of one rank, same document map, nothing sharded or
gathered). The two one-device forwards round differently, and a MoE router near a tie turns the rounding into a
different second expert at one position.

This script builds the spec's tiny model, runs the one-device forward plainly (eager) and under ``cp_kernels``
(FlexAttention), and compares the logits ``[B, S, V]`` the way the harness does: normwise, in ULPs of bfloat16
at the largest eager logit (``max |a - b| / (max |eager| x 2**-7)``), against the harness's bound for this
batch, 8 ULP (4 x reference spread 0, a one-row batch without a backward, + floor 8). It prints the worst
position and both values and exits 1 while the two differ by more than the bound.

Run: ``PYTHONPATH=. python examples/automodel/repro/models/kimi_bf16_kernels.py [--spec kimi_k3]
[--seq-len 12 --seed 17]`` (default: both specs, each on the smallest plain batch verify failed on, ``CASES``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

import torch

BOUND_ULP = 8.0  # the harness's bound for a bfloat16 tensor whose reference spread is 0 (docs/real_models.md)
# the smallest verify failures (--examples 12, CP 2): plain batches (seq_len, seed) and what CP printed
CASES = {
    "kimi_linear": (12, 17, "CP error 50.2 ULP, position 11, CP -0.7109375, one device 0.58203125"),
    "kimi_k3": (7, 2, "CP error 42.9 ULP, position 6, CP -1.2265625, one device -0.21484375"),
}


def compare(name: str, seq_len: int, seed: int) -> float:
    """Print the one-device eager vs one-device FlexAttention logits ``[B, S, V]`` of spec ``name`` (bfloat16,
    model seed 0) on the plain batch ``(seq_len, seed)``; return their normwise difference in ULPs."""
    spec = importlib.import_module(f"examples.automodel.models.{name}")
    model = spec.build(torch.bfloat16, 0)
    batch = spec.make_batch("plain", seq_len, seed=seed)
    local = spec.shard(model, None, batch)[1]  # one device: the framework's identity sharder
    with torch.no_grad():
        eager = spec.forward(model, local).float()
        with spec.cp_kernels(model) as kernels:
            flex = spec.forward(model, local).float()
    eps = torch.finfo(torch.bfloat16).eps
    scale = float(eager.abs().max())
    diff = (flex - eager).abs()
    ulp = float(diff.max()) / (scale * eps)
    row, position, entry = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    print(f"{name} bfloat16, plain batch of {seq_len} (seed {seed}), one process, logits {list(eager.shape)}")
    print(f"  one device eager (matmul + softmax) vs one device under cp_kernels ({kernels}):")
    print(
        f"  {ulp:.1f} ULP of bfloat16 at the largest logit {scale:.3g} (bound {BOUND_ULP:g}); "
        f"{int((diff > BOUND_ULP * scale * eps).sum())} elements above the bound"
    )
    print(
        f"  worst at row {row}, position {position}, vocabulary entry {entry}: eager "
        f"{eager[row, position, entry].item()!r}, FlexAttention {flex[row, position, entry].item()!r} "
        f"({float(diff.max()):.3g} absolute)"
    )
    print("  ULP per position:", " ".join(f"{v:.1f}" for v in (diff[row].amax(-1) / (scale * eps)).tolist()))
    if name in CASES and CASES[name][:2] == (seq_len, seed):
        print(f"  (the harness at CP 2 on this batch: {CASES[name][2]})")
    return ulp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", choices=sorted(CASES), help="one spec (default: both, each on its case)")
    parser.add_argument("--seq-len", type=int, help="plain batch length (default: the spec's case)")
    parser.add_argument("--seed", type=int, help="the batch's seed (default: the spec's case; the model's is 0)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")  # FlexAttention's "called without torch.compile", transformers' torch_dtype
    worst = 0.0
    for name in [args.spec] if args.spec else sorted(CASES):
        seq_len, seed, _ = CASES[name]
        worst = max(worst, compare(name, args.seq_len or seq_len, args.seed if args.seed is not None else seed))
    if worst > BOUND_ULP:
        print(
            f"exit 1: the two one-device kernels differ by {worst:.1f} ULP > {BOUND_ULP:g}: the CP path's kernel "
            "alone moves the result by as much as CP does"
        )
        return 1
    print("exit 0: the two one-device kernels agree within the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
