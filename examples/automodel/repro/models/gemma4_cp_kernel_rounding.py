"""Gemma4 MoE on ONE process: computing attention with the kernel of its CP ring (FlexAttention's dense path)
instead of HF eager attention moves the same gradients, by as much, as CP does (nemo-automodel 0.7.0, CPU, no
ranks, no harness). Finding M5 (``docs/models/gemma4_moe.md``, G3 and G4).

The default case is the float32 one ``real_clients`` reached on 2026-12-05 (a plain row of 2 tokens, seed 2, CP 2):
only token 0 has a target, and token 0 attends to one key, so every query-side gradient is mathematically zero.
HF eager attention differentiates the softmax as ``P * (dP - sum(P * dP))``, which is exactly 0 when ``P`` is
``[1, 0, ...]``; FlexAttention's backward (what Gemma4's ring runs on every chunk) forms ``dP - sum(dO * O)`` from
two differently rounded dot products, so the gradient of layer 3's ``q_proj`` is rounding noise (CP gives
6.85e-07 where one device gives 0; the harness's float32 floor of 1024 ULP at 2^-10 of the case's largest
gradient is 5.9e-07). ``--mechanism`` shows that in plain torch on one attention call.

The script builds the spec's tiny model and runs one device's training step twice: as the recipe runs it
(``attn_implementation`` eager) and under ``spec.cp_kernels`` (the same forward, attention by FlexAttention under
the model's own mask; torch refuses FlexAttention's backward on a CPU in ``_validate_device`` only, which this
script lifts the way the harness's ``flex_backward_cpu`` stand-in does). It prints the gradients that move most,
in ULPs of the dtype at the tensor's largest value, or at no less than 2^-10 of the case's largest gradient (the
harness's scale floor), and exits 1 when some gradient moves by more than the floor (1024 ULP float32, 8 ULP
bfloat16): the kernel change alone exceeds the bound a reference spread of 0 leaves.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=. python examples/automodel/repro/models/gemma4_cp_kernel_rounding.py``
(float32, exit 1); ``... --dtype bfloat16 --kind right_padded --seq-len 7 --pad 2 --seed 790`` (M5's bfloat16
case); ``... --mechanism`` (one attention call, no model).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

FLOOR_ULP = {"float32": 1024.0, "bfloat16": 8.0}
SCALE_FLOOR = 2.0**-10


def lift_flex_cpu_backward_refusal() -> None:
    from torch.nn.attention import flex_attention

    original = flex_attention._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        original(query.detach(), key.detach(), value.detach())

    flex_attention._validate_device = validate_device


def grads(spec, dtype: torch.dtype, batch: dict, kernels: bool) -> dict[str, torch.Tensor]:
    import contextlib

    model = spec.build(dtype, 0)
    with spec.cp_kernels(model) if kernels else contextlib.nullcontext():
        logits = spec.forward(model, batch)
        spec.loss(logits, batch["labels"], spec.num_label_tokens(batch)).backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def mechanism() -> int:
    """One attention call, 4 tokens, head dim 16: the loss reads token 0 only (one visible key)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lift_flex_cpu_backward_refusal()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 16, requires_grad=True) for _ in range(3))
    weight = torch.zeros(1, 2, 4, 16)
    weight[:, :, 0] = torch.randn(1, 2, 16)
    scores = q @ k.transpose(-1, -2) / 4.0
    scores = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    ((scores.softmax(-1) @ v) * weight).sum().backward()
    assert q.grad is not None
    eager = q.grad[:, :, 0].abs().max().item()
    q.grad = None
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 4, 4, device="cpu")
    (flex_attention(q, k, v, block_mask=mask) * weight).sum().backward()
    flex = q.grad[:, :, 0].abs().max().item()  # type: ignore[index]  # set by backward
    print(f"dq of a query with one visible key: eager softmax {eager:.3g}, FlexAttention {flex:.3g}")
    return 1 if eager == 0.0 and flex != 0.0 else 0


def main() -> int:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=sorted(FLOOR_ULP))
    parser.add_argument("--kind", default="plain")
    parser.add_argument("--seq-len", type=int, default=2)
    parser.add_argument("--pad", type=int, default=0)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--mechanism", action="store_true")
    args = parser.parse_args()
    if args.mechanism:
        return mechanism()
    from examples.automodel.models import gemma4_moe as spec

    lift_flex_cpu_backward_refusal()
    dtype = getattr(torch, args.dtype)
    extra = {"pad": args.pad} if args.kind == "right_padded" else {}
    batch = spec.make_batch(args.kind, args.seq_len, seed=args.seed, **extra)
    eager = grads(spec, dtype, batch, kernels=False)
    flex = grads(spec, dtype, batch, kernels=True)
    largest = max(float(g.abs().max()) for g in eager.values())
    unit = torch.finfo(dtype).eps

    def moved(name: str) -> float:
        scale = max(float(eager[name].abs().max()), largest * SCALE_FLOOR)
        return float((flex[name] - eager[name]).abs().max()) / (scale * unit)

    ranked = sorted(((moved(n), n) for n in eager), reverse=True)
    print(f"Gemma4 MoE {args.dtype}, one device, {args.kind} seq_len {args.seq_len} seed {args.seed}:")
    print("  CP ring's kernel (FlexAttention) vs eager attention, ULPs at the tensor's largest value")
    for value, name in ranked[:5]:
        print(f"  {name}: {value:.3g} ULP (eager max |g| {float(eager[name].abs().max()):.3g}, "
              f"FlexAttention max |g| {float(flex[name].abs().max()):.3g})")  # fmt: skip
    worst, floor = ranked[0][0], FLOOR_ULP[args.dtype]
    print(f"worst {worst:.3g} ULP {'>' if worst > floor else '<='} floor {floor:g}")
    return 1 if worst > floor else 0


if __name__ == "__main__":
    sys.exit(main())
