"""Measure what the excess judge and the ULP budgets rest on: ``python -m cp_harness.calibrate``.

For each row of every arithmetic check (``Check.arithmetic``: today the loss and each model) and each dtype it
has a budget for, it draws cases
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
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import seed as hypothesis_seed

from cp_harness import checks, options
from cp_harness.cases.descriptions import canonical
from cp_harness.cases.implementation import impl_names
from cp_harness.cases.profiles import CaseSpace, command_settings
from cp_harness.judging import excess
from cp_harness.judging.policy import UNJUDGED
from cp_harness.ranks.pool import PoolConfig
from cp_harness.runner import CaseRunner

FLOORS = (0.5, 1.0, 2.0, 4.0, 8.0)
MEASURES = {"elementwise": 1 / 1024, "f1/32": 1 / 32, "normwise": 1.0}


def _terms(comp, ref, fraction: float) -> dict:
    """CP and one-rank errors of a comparison in the measure with floor ``fraction``, and the ``c`` each floor needs."""
    ulp, _ = excess.element_terms(comp, 0.0, fraction)
    out: dict[str, Any] = {"cp": float(ulp.max()) if ulp.size else 0.0, "one_rank": None, "need": {}}
    if ref is not None:
        base_ulp, _ = excess.element_terms(ref, 0.0, fraction)
        base = float(base_ulp.max()) if base_ulp.size else 0.0
        out["one_rank"] = base if np.isfinite(base) else 0.0
        for k in FLOORS:
            _, floor = excess.element_terms(comp, k, fraction)
            out["need"][str(k)] = excess.needed_limit(ulp, floor, out["one_rank"])
    return out


def _rows(dtypes) -> list[tuple[str, Callable[..., Any]]]:
    """``(name, strategy factory)`` of every arithmetic check's verify rows (each row draws one dtype, or
    several: then one row per dtype it has a budget for), for the ``dtypes`` asked. A new arithmetic check is
    calibrated as soon as it is registered."""
    rows = []
    for check in checks.load_checks().values():
        if not check.arithmetic:
            continue
        for row in check.rows:
            for dtype in row.dtypes:
                if dtype not in dtypes or dtype not in check.budgets:
                    continue  # e.g. the miniature models are not float16-safe (rms_norm's eps is subnormal there)
                name = f"{row.id} {dtype}" if len(row.dtypes) > 1 else row.id
                rows.append((name, lambda space, r=row, d=dtype: r.cases(space).filter(lambda c, d=d: c["dtype"] == d)))
    return rows


def measure(runner: CaseRunner, strategy, space: CaseSpace, examples: int, seed: int) -> list[dict]:
    pairs: list[dict] = []

    @command_settings("calibrate", examples)
    @hypothesis_seed(seed)
    @given(case=strategy(space))
    def property_(case):
        report = runner.run(case)
        base_case = checks.check_of(case).baseline_case(case)
        reference = {}
        if base_case is not None and not report.problems:
            reference = {c.name: c for c in runner.baseline(base_case).comparisons if excess.pairs_with_baseline(c)}
        for c in report.comparisons:
            if not c.arithmetic:
                continue
            entry = {
                "case": canonical(case),
                "n": int(case["world_size"]),
                "tensor": c.name,
                "measure": c.ulp_dtype,
                "floor_fraction": c.floor_fraction,
                "cp": c.max_ulp,
                "one_rank": c.excess.baseline if c.excess is not None else None,
                "rank": c.rank,
                "problems": len(report.problems),
                "by_measure": {},
            }
            ref = reference.get(c.name) if excess.pairs_with_baseline(c) else None
            for label, fraction in MEASURES.items():
                entry["by_measure"][label] = _terms(c, ref, fraction)
            pairs.append(entry)

    property_()
    return pairs


def summary(name: str, pairs: list[dict]) -> dict:
    multi = [p for p in pairs if p["one_rank"] is not None and not p["problems"]]
    out: dict[str, Any] = {
        "row": name,
        "tensors": len(pairs),
        "cases": len({p["case"] for p in pairs}),
        "multi_rank_tensors": len(multi),
        "by_measure": {},
    }
    for label in MEASURES:
        m = [p["by_measure"][label] for p in multi if p["by_measure"][label]["one_rank"] is not None]
        n1 = [p["by_measure"][label]["cp"] for p in pairs if p["n"] == 1 and not p["problems"]]
        worst_ratio: dict[str, float] = collections.defaultdict(float)
        for p in multi:
            t = p["by_measure"][label]
            if t["one_rank"]:
                key = p["tensor"]
                worst_ratio[key] = max(worst_ratio[key], t["cp"] / t["one_rank"])
        out["by_measure"][label] = {
            "worst_cp": max([0.0] + [t["cp"] for t in m]),
            "worst_one_rank": max([0.0] + [t["one_rank"] for t in m]),
            "worst_n1_case": max([0.0] + n1),
            "worst_ratio": max(worst_ratio.values(), default=0.0),
            "worst_ratio_tensors": dict(sorted(worst_ratio.items(), key=lambda kv: -kv[1])[:3]),
            "c_needed": {str(k): max([0.0] + [t["need"][str(k)] for t in m]) for k in FLOORS},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cp_harness.calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    options.add_cli_options(parser, "calibrate")
    args = parser.parse_args(argv)
    values = options.from_cli(args)  # the one read of $CP_IMPL
    sizes = values["world_sizes"] if args.world_sizes is not None else (2, 3, 4, 8)  # the judge is about N > 1
    examples = values["examples"] if args.examples is not None else 50
    dtypes = values["dtypes"] or ("float64", "float32", "bfloat16", "float16")
    wanted = values["rows"]
    rows = [(n, s) for n, s in _rows(dtypes) if not wanted or any(w in n for w in wanted)]
    space = CaseSpace(world_sizes=tuple(sizes), impls=impl_names(values["impl"]))
    # Every error measured, none judged: the judge's own numbers are what is being measured.
    runner = CaseRunner(
        PoolConfig(world_size=max(sizes), impl=values["impl"], backend=values["backend"], launcher=values["launcher"]),
        policy=UNJUDGED,
    )
    results, everything = [], {}
    started = time.perf_counter()
    try:
        for name, strategy in rows:
            t0 = time.perf_counter()
            pairs = measure(runner, strategy, space, examples, values["seed"])
            everything[name] = pairs
            s = summary(name, pairs)
            s["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(s)
            print(
                f"{name}: {s['cases']} cases, {s['multi_rank_tensors']} multi-rank tensors ({s['seconds']} s)",
                flush=True,
            )
            for label, m in s["by_measure"].items():
                need = ", ".join(f"k={k}: {v:.3g}" for k, v in m["c_needed"].items())
                print(
                    f"    {label:<12} worst CP {m['worst_cp']:.3g}  one-rank {m['worst_one_rank']:.3g} "
                    f"(N=1 cases {m['worst_n1_case']:.3g})  ratio {m['worst_ratio']:.3g}  c needed: {need}  "
                    f"{m['worst_ratio_tensors']}",
                    flush=True,
                )
    finally:
        runner.close()
    print(f"{time.perf_counter() - started:.0f} s, {runner.tally.baseline_runs} one-rank runs", file=sys.stderr)
    if values["json_path"]:
        with open(values["json_path"], "w") as f:
            json.dump(
                {
                    "impl": values["impl"],
                    "world_sizes": list(sizes),
                    "seed": values["seed"],
                    "examples": examples,
                    "rows": results,
                    "pairs": everything,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
