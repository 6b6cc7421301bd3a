"""One process, no CP, no harness: ``nemotron_v3_mamba``'s one-device step computed twice in one dtype, with the
one-device mixer's fused kernel call (what the harness's reference runs) and with the kernel calls the CP path
makes (``nemotron_v3_mamba.cp_kernels``: the scan with the gate, then ``rmsnorm_fn`` and ``out_proj``, through the
framework's ``MambaContextParallel`` over one rank), both on the stand-in ``mamba_kernels_cpu``, against the same
step in float32. Prints, per Mamba parameter gradient, the largest difference between the two bfloat16 runs and
each one's distance from float32 (finding M6, docs/models/nemotron_v3_mamba.md).

    PYTHONPATH=. .venv/bin/python examples/automodel/repro/models/nemotron_bf16_mamba_kernels.py --seq-len 21 --batch-size 2 --seed 642

With ``--seeds 790,1,2,...`` (finding M10: one-row batches, here right-padded rows of 7 with pad 2): per seed, only the
two ``D`` gradients, in ULPs of bfloat16 at the fused run's largest value (the harness's unit): how far the two
one-device bfloat16 runs are apart and how far each is from float32. Exits 1 when the two one-device runs differ by
more than 8 ULP (the harness's bfloat16 floor, all a one-row batch's bound is) on some seed.

    PYTHONPATH=. .venv/bin/python examples/automodel/repro/models/nemotron_bf16_mamba_kernels.py --kind right_padded --seq-len 7 --batch-size 1 --pad 2 --seeds 790,1,2,3,4,5,6,7
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=21)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=642, help="the batch's seed (the model's is 0)")
    parser.add_argument("--kind", default="plain")
    parser.add_argument("--pad", type=int, default=None, help="right padding (kind right_padded)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seeds", default=None, help="comma-separated batch seeds: the D-gradient scatter table")
    args = parser.parse_args(argv)

    from cp_harness.standins import mamba_kernels_cpu
    from cp_harness.usage import model_specs
    from examples.automodel.models import nemotron_v3_mamba as spec

    keywords = {} if args.pad is None else {"pad": args.pad}
    batch = spec.make_batch(args.kind, args.seq_len, batch_size=args.batch_size, seed=args.seed, **keywords)

    def run(dtype: torch.dtype, kernels: bool) -> dict:
        model = spec.build(dtype, 0)
        with mamba_kernels_cpu.install(), spec.cp_kernels(model) if kernels else contextlib.nullcontext():
            return model_specs.step(spec, model, None, batch)

    if args.seeds is not None:
        worst = 0.0
        print(
            "seed  D gradient (worst of the Mamba layers), ULP: |fused - CP kernels|  |fused - f32|  |CP kernels - f32|"
        )
        for seed in (int(s) for s in args.seeds.split(",")):
            batch = spec.make_batch(args.kind, args.seq_len, batch_size=args.batch_size, seed=seed, **keywords)
            truth, fused = run(torch.float32, False)["grads"], run(torch.bfloat16, False)["grads"]
            split = run(torch.bfloat16, True)["grads"]
            apart = [0.0, 0.0, 0.0]
            for name in (n for n in truth if n.endswith("._fp32_params.D")):
                t, a, b = (g[name].float() for g in (truth, fused, split))
                unit = float(a.abs().max()) * 2.0**-7
                for i, (x, y) in enumerate(((a, b), (a, t), (b, t))):
                    apart[i] = max(apart[i], float((x - y).abs().max()) / unit)
            worst = max(worst, apart[0])
            print(f"{seed:5} {apart[0]:43.1f} {apart[1]:13.1f} {apart[2]:18.1f}")
        print(f"two one-device bfloat16 runs differ by up to {worst:.1f} ULP ({'>' if worst > 8 else '<='} 8)")
        sys.exit(1 if worst > 8 else 0)

    truth = run(torch.float32, False)
    fused, split = run(model_specs.DTYPES[args.dtype], False), run(model_specs.DTYPES[args.dtype], True)
    print(f"{'parameter':45} {'|fused - CP kernels|':>20} {'|fused - f32|':>14} {'|CP kernels - f32|':>18}")
    for name in truth["grads"]:
        if ".mixer." not in name or "layers.1." in name or "layers.3." in name:
            continue
        t, a, b = (r["grads"][name].float() for r in (truth, fused, split))
        if name.endswith("._fp32_params.D"):
            print(f"  {name}: float32 {t.tolist()}\n  fused {a.tolist()}\n  CP kernels {b.tolist()}")
        print(f"{name:45} {(a - b).abs().max().item():20.3e} {(a - t).abs().max().item():14.3e} "
              f"{(b - t).abs().max().item():18.3e}")  # fmt: skip


if __name__ == "__main__":
    main()
