"""Measure what the excess judge and the ULP budgets rest on: ``python -m cp_harness.calibrate``.

For each arithmetic row (the loss, each model) and each dtype it draws cases
with Hypothesis (as ``verify`` does), runs them on the pool with the judge
switched off (no budget, no limit), and records for every tensor compared in
ULPs: the error of the CP run, the error of the same implementation on one
rank, and their ratio. It prints, per row and dtype: the worst CP error, the
worst one-rank error, the worst ratio, and the smallest ``c`` that passes
every tensor for each candidate floor; ``--json`` keeps every pair. Run it on
every implementation that the figures in ``cp_harness.judging.excess`` should hold
for (``docs/budgets.md`` lists the runs behind them)::

    python -m cp_harness.calibrate --impl cp_impl --examples 100 --json reports/calibrate-cp_impl.json
    PYTHONPATH=tests/fixtures python -m cp_harness.calibrate --impl alt_reduction_order ...
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import numpy as np

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings

from cp_harness import checks
from cp_harness.cases.descriptions import canonical
from cp_harness.checks.loss import SHIFTED_CP_LOSS, loss_cases
from cp_harness.checks.models import MODEL, model_cases
from cp_harness.judging import excess
from cp_harness.judging.policy import UNJUDGED
from cp_harness.ranks.pool import PoolConfig
from cp_harness.runner import CaseRunner

FLOORS = (0.5, 1.0, 2.0, 4.0, 8.0)
MEASURES = {"elementwise": 1 / 1024, "f1/32": 1 / 32, "normwise": 1.0}


def _terms(comp, ref, fraction: float) -> dict:
    """CP and one-rank errors of a comparison in the measure with floor ``fraction``, and the ``c`` each floor needs."""
    ulp, _ = excess.element_terms(comp, 0.0, fraction)
    out = {"cp": float(ulp.max()) if ulp.size else 0.0, "one_rank": None, "need": {}}
    if ref is not None:
        base_ulp, _ = excess.element_terms(ref, 0.0, fraction)
        base = float(base_ulp.max()) if base_ulp.size else 0.0
        out["one_rank"] = base if np.isfinite(base) else 0.0
        for k in FLOORS:
            _, floor = excess.element_terms(comp, k, fraction)
            out["need"][str(k)] = excess.needed_limit(ulp, floor, out["one_rank"])
    return out


def _rows(dtypes):
    """``(name, strategy factory)`` per arithmetic check and dtype it has a budget for."""
    rows = []
    for dtype in dtypes:
        if dtype in SHIFTED_CP_LOSS.budgets:
            rows.append((f"{SHIFTED_CP_LOSS.name} {dtype}",
                         lambda s, d=dtype: loss_cases(s).filter(lambda c, d=d: c["dtype"] == d)))
        if dtype not in MODEL.budgets:
            continue  # the miniature models are not float16-safe (rms_norm's eps is subnormal there)
        for model in ("inkling2", "mistral_large4"):
            rows.append((f"{MODEL.name} {model} {dtype}", lambda s, d=dtype, m=model: model_cases(
                s, dtypes=(d,)).filter(lambda c, m=m: c["model"] == m)))
    return rows


def measure(runner: CaseRunner, strategy, sizes, examples: int, seed: int) -> list[dict]:
    pairs: list[dict] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @hypothesis_seed(seed)
    @given(case=strategy(sizes))
    def property_(case):
        report = runner.run(case)
        base_case = checks.check_of(case).baseline_case(case)
        reference = {}
        if base_case is not None and not report.problems:
            reference = {c.name: c for c in runner.baseline(base_case).comparisons if c.mode == "ulp"}
        for c in report.comparisons:
            if c.mode != "ulp":
                continue
            entry = {"case": canonical(case), "n": int(case["world_size"]), "tensor": c.name,
                     "measure": c.ulp_dtype, "floor_fraction": c.floor_fraction, "cp": c.max_ulp,
                     "one_rank": c.baseline_ulp, "problems": len(report.problems), "by_measure": {}}
            ref = reference.get(excess.baseline_name(c.name) or "")
            for label, fraction in MEASURES.items():
                entry["by_measure"][label] = _terms(c, ref, fraction)
            pairs.append(entry)

    property_()
    return pairs


def summary(name: str, pairs: list[dict]) -> dict:
    multi = [p for p in pairs if p["one_rank"] is not None and not p["problems"]]
    out = {"row": name, "tensors": len(pairs), "cases": len({p["case"] for p in pairs}),
           "multi_rank_tensors": len(multi), "by_measure": {}}
    for label in MEASURES:
        m = [p["by_measure"][label] for p in multi if p["by_measure"][label]["one_rank"] is not None]
        n1 = [p["by_measure"][label]["cp"] for p in pairs if p["n"] == 1 and not p["problems"]]
        worst_ratio: dict[str, float] = collections.defaultdict(float)
        for p in multi:
            t = p["by_measure"][label]
            if t["one_rank"]:
                key = p["tensor"].split("@")[0]
                worst_ratio[key] = max(worst_ratio[key], t["cp"] / t["one_rank"])
        out["by_measure"][label] = {
            "worst_cp": max([0.0] + [t["cp"] for t in m]),
            "worst_one_rank": max([0.0] + [t["one_rank"] for t in m]),
            "worst_n1_case": max([0.0] + n1),
            "worst_ratio": max(worst_ratio.values(), default=0.0),
            "worst_ratio_tensors": dict(sorted(worst_ratio.items(), key=lambda kv: -kv[1])[:3]),
            "c_needed": {str(k): max([0.0] + [t["need"][str(k)] for t in m]) for k in FLOORS}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_harness.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="cp_impl")
    parser.add_argument("--examples", type=int, default=50, help="examples per row (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-sizes", default="2,3,4,8")
    parser.add_argument("--dtypes", default="float64,float32,bfloat16,float16")
    parser.add_argument("--rows", default="", help="only rows whose name contains one of these (comma-separated)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    from cp_harness.cases.descriptions import parse_world_sizes

    sizes = parse_world_sizes(args.world_sizes)
    wanted = [w for w in args.rows.split(",") if w]
    rows = [(n, s) for n, s in _rows(args.dtypes.split(",")) if not wanted or any(w in n for w in wanted)]
    # Every error measured, none judged: the judge's own numbers are what is being measured.
    runner = CaseRunner(PoolConfig(world_size=max(sizes), impl=args.impl), policy=UNJUDGED)
    results, everything = [], {}
    started = time.perf_counter()
    try:
        for name, strategy in rows:
            t0 = time.perf_counter()
            pairs = measure(runner, strategy, sizes, args.examples, args.seed)
            everything[name] = pairs
            s = summary(name, pairs)
            s["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(s)
            print(f"{name}: {s['cases']} cases, {s['multi_rank_tensors']} multi-rank tensors ({s['seconds']} s)",
                  flush=True)
            for label, m in s["by_measure"].items():
                need = ", ".join(f"k={k}: {v:.3g}" for k, v in m["c_needed"].items())
                print(f"    {label:<12} worst CP {m['worst_cp']:.3g}  one-rank {m['worst_one_rank']:.3g} "
                      f"(N=1 cases {m['worst_n1_case']:.3g})  ratio {m['worst_ratio']:.3g}  c needed: {need}  "
                      f"{m['worst_ratio_tensors']}", flush=True)
    finally:
        runner.close()
    print(f"{time.perf_counter() - started:.0f} s, {runner.tally.baseline_runs} one-rank runs", file=sys.stderr)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"impl": args.impl, "world_sizes": list(sizes), "seed": args.seed, "examples": args.examples,
                       "rows": results, "pairs": everything}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
