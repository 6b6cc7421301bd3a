"""Gemma4 MoE in bfloat16 on ONE process: changing only the attention kernel moves the attention-side parameter
gradients by as much as CP does (nemo-automodel 0.7.0, CPU, no ranks, no harness).

With gradients judged on the CPU (stand-in ``flex_backward_cpu``), Gemma4's bfloat16 row fails on unpacked
batches at CP 2 by a few ULP over the 8-ULP floor on gradients that flow only through the attention scores
(layer 0's ``q_norm``, ``k_norm``, ``k_proj``), logits and loss passing. One device computes attention by HF
eager attention (bfloat16 matmul, softmax, matmul, each rounded); CP by FlexAttention's dense path (scores,
softmax and its backward in float32). This script builds the spec's tiny model and runs one device's training
step twice, with ``attn_implementation`` "eager" (the spec's one-device default) and "sdpa" (the CPU SDPA kernel,
float32 accumulation), and compares every parameter gradient as the harness does (normwise, ULPs of bfloat16 at
the eager tensor's largest value), and both against the float32 model of the same weights. It prints the
gradients the kernel change moves most and exits 1 if any moves by more than the harness's bound for a
reference spread of 0 (8 ULP).

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=. python examples/automodel/repro/models/gemma4_bf16_attention_kernels.py
[--kind right_padded --seq-len 7 --pad 2 --seed 790]`` (default: the smallest case verify failed on).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

BOUND_ULP = 8.0


def grads(spec, dtype, attention: str, batch: dict) -> dict[str, torch.Tensor]:
    model = spec.build(dtype, 0, attn_implementation=attention)
    ctx_factory, local, _ = spec.shard(model, None, batch)
    with ctx_factory():
        logits = spec.forward(model, local)
        labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
        spec.loss(logits, labels, spec.num_label_tokens(batch)).backward()
    return {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}


def ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) * 2.0**-7
    return float((a - b).abs().max()) / scale if scale else 0.0


def main() -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="right_padded")
    parser.add_argument("--seq-len", type=int, default=7)
    parser.add_argument("--pad", type=int, default=2)
    parser.add_argument("--seed", type=int, default=790)
    args = parser.parse_args()
    from examples.automodel.models import gemma4_moe as spec

    extra = {"pad": args.pad} if args.kind == "right_padded" else {}
    batch = spec.make_batch(args.kind, args.seq_len, seed=args.seed, **extra)
    eager = grads(spec, torch.bfloat16, "eager", batch)
    sdpa = grads(spec, torch.bfloat16, "sdpa", batch)
    truth = grads(spec, torch.float32, "eager", batch)
    moved = sorted(((ulp(sdpa[n], eager[n]), n) for n in eager), reverse=True)
    print(f"Gemma4 MoE bfloat16, one device, {args.kind} seq_len {args.seq_len} seed {args.seed}: sdpa vs eager")
    for value, name in moved[:6]:
        print(
            f"  {name}: {value:.1f} ULP  (eager vs float32: {ulp(eager[name], truth[name]):.1f}, "
            f"sdpa vs float32: {ulp(sdpa[name], truth[name]):.1f})"
        )
    worst = moved[0][0]
    print(f"worst {worst:.1f} ULP {'>' if worst > BOUND_ULP else '<='} bound {BOUND_ULP}")
    return 1 if worst > BOUND_ULP else 0


if __name__ == "__main__":
    sys.exit(main())
