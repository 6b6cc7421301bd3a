"""One process, no CP, no harness: ``nemotron_v3_mamba``'s one-device step computed twice in one dtype, with the
one-device mixer's fused kernel call (what the harness's reference runs) and with the kernel calls the CP path
makes (``nemotron_v3_mamba.cp_kernels``: the scan with the gate, then ``rmsnorm_fn`` and ``out_proj``, through the
framework's ``MambaContextParallel`` over one rank), both on the stand-in ``mamba_kernels_cpu``, against the same
step in float32. Prints, per Mamba parameter gradient, the largest difference between the two bfloat16 runs and
each one's distance from float32 (finding M6, docs/models/nemotron_v3_mamba.md).

    PYTHONPATH=. .venv/bin/python examples/automodel/repro/models/nemotron_bf16_mamba_kernels.py --seq-len 21 --batch-size 2 --seed 642
"""

from __future__ import annotations

import argparse
import contextlib

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=21)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=642, help="the batch's seed (the model's is 0)")
    parser.add_argument("--kind", default="plain")
    parser.add_argument("--pad", type=int, default=None, help="right padding (kind right_padded)")
    parser.add_argument("--dtype", default="bfloat16")
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
