"""Calibration figures of one model spec under the real-model judge: every drawn case is run (none is shrunk or
stopped at), and the worst CP error, reference spread and error / bound are printed per dtype and tensor kind.

    PYTHONPATH=. python examples/automodel/tools/calibrate_spec.py \
        --model examples.automodel.models.glm5_next --examples 40 --world-sizes 1,2,3

Cases: the real-model rows' own strategy (``cp_harness.checks.real_model.real_model_cases``, as ``verify`` draws
them with ``--seed``), restricted to what the spec declares (``WORLD_SIZES``, ``BATCH_KINDS``, ``BATCH_ROWS``; formerly ``verify_declared.declared``); ``--smoke`` adds the
harness's named smoke cases for the spec. Per case the harness's own judge runs (``C x spread + floor``,
``docs/real_models.md``); a kind is ``logits``, ``loss`` or ``grad`` (every parameter gradient). Error and spread
are ULPs of the dtype at the tensor's largest one-device value; ``ratio`` is error / bound (> 1 fails).
``--exclude-packed`` leaves out packed batches (to measure the rest of a model whose packed cases fail for a
diagnosed reason); ``--overrides`` sets config fields of every case. Failing cases are listed with their
failing tensors; ``--json`` keeps every case.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any


def draw_cases(model: str, examples: int, world_sizes: tuple[int, ...], seed: int, admits) -> list[dict]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from cp_harness.cases.profiles import CaseSpace
    from cp_harness.checks.real_model import real_model_cases

    space = CaseSpace(world_sizes=world_sizes, dtypes=("float32", "bfloat16"), models=(model,))
    cases: list[dict] = []
    for dtype in ("float32", "bfloat16"):

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @hypothesis_seed(seed)
        @given(case=real_model_cases(dtype)(space).filter(admits))
        def collect(case):
            cases.append(case)

        collect()
    return cases


def kind(name: str) -> str:
    return "grad" if name.startswith("grad ") else name.split(" (")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--examples", type=int, default=40, help="drawn cases per dtype")
    parser.add_argument("--world-sizes", default="1,2,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="also the harness's named smoke cases")
    parser.add_argument("--exclude-packed", action="store_true")
    parser.add_argument(
        "--overrides", default="", help="config overrides of every case, e.g. router_aux_loss_coef=1e-3"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    overrides = {k: json.loads(v) for k, v in (item.split("=") for item in filter(None, args.overrides.split(",")))}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from cp_harness.checks.real_model import FLOOR, C, smoke_cases
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner
    from cp_harness.usage.model_specs import spec_traits

    traits = spec_traits(args.model)

    def admits(case: dict) -> bool:  # what the spec declares (the harness's own draws honour the same)
        batch = case["batch"]
        return (
            (traits.world_sizes is None or int(case["world_size"]) in traits.world_sizes)
            and batch["kind"] in traits.batch_kinds
            and int(batch.get("batch_size", 1)) in traits.rows_for(batch["kind"])
        )

    sizes = tuple(int(n) for n in args.world_sizes.split(","))
    cases = draw_cases(args.model, args.examples, sizes, args.seed, admits)
    if args.smoke:
        cases = [c for c in smoke_cases(args.model) if admits(c)] + cases
    if args.exclude_packed:
        cases = [c for c in cases if c["batch"]["kind"] != "packed"]
    if overrides:
        cases = [{**c, "overrides": overrides} for c in cases]
    runner = CaseRunner(PoolConfig(world_size=max(sizes), impl="cp_impl", case_timeout=300.0, preload=(args.model,)))
    worst: dict = collections.defaultdict(lambda: {"error": 0.0, "spread": 0.0, "ratio": 0.0, "at": None})
    records, failing, seconds = [], [], []
    try:
        runner.pool.start()
        for i, case in enumerate(cases):
            started = time.perf_counter()
            report = runner.run(case)
            seconds.append((int(case["world_size"]), time.perf_counter() - started))
            record: dict[str, Any] = {"case": case, "ok": report.ok, "problems": report.problems, "tensors": {}}
            for comparison in report.comparisons:
                verdict = getattr(comparison, "excess", None)
                if verdict is None:
                    continue
                bound = C * verdict.baseline + FLOOR[case["dtype"]]
                ratio = verdict.error / bound
                record["tensors"][comparison.name] = [verdict.error, verdict.baseline, ratio]
                cell = worst[(case["dtype"], kind(comparison.name))]
                cell["spread"] = max(cell["spread"], verdict.baseline)
                if verdict.error > cell["error"]:
                    cell["error"], cell["at"] = verdict.error, i
                cell["ratio"] = max(cell["ratio"], ratio)
            records.append(record)
            if not report.ok:
                names = [c.name.split(" (")[0] for c in report.comparisons if not c.ok]
                failing.append((i, case, names, report.problems[:1]))
            print(
                f"case {i + 1}/{len(cases)} {'ok' if report.ok else 'FAILED'} "
                f"{json.dumps(case, sort_keys=True, separators=(',', ':'))}",
                flush=True,
            )
    finally:
        runner.close()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)
    print(f"\n{args.model}: {len(cases)} cases, {len(failing)} failed; C = {C:g}, floor {FLOOR}")
    print(f"{'dtype':9} {'kind':7} {'worst error ULP':>16} {'worst spread ULP':>17} {'worst error/bound':>18}  case")
    for (dtype, name), cell in sorted(worst.items()):
        at = "" if cell["at"] is None else f"#{cell['at'] + 1}"
        print(f"{dtype:9} {name:7} {cell['error']:16.3g} {cell['spread']:17.3g} {cell['ratio']:18.3g}  {at}")
    for n in sorted({n for n, _ in seconds}):
        times = sorted(s for m, s in seconds if m == n)
        print(f"CP {n}: {len(times)} cases, median {times[len(times) // 2]:.2f} s per case (min {times[0]:.2f})")
    for i, case, names, problems in failing:
        print(
            f"FAILED #{i + 1}: {json.dumps(case, sort_keys=True, separators=(',', ':'))}\n    "
            f"tensors: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''} {problems}"
        )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
