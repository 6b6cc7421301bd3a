"""Benchmarks: harness throughput and communication volume against their limits.

``python -m cp_harness bench [--json PATH] [--quick] [--skip-suite] [--skip-fresh] ...``

One run measures, on this machine and under the same load:

- **throughput**: verified CP cases per second on the warm rank pool for the
  standard case (a miniature-model forward and backward on every rank plus
  the float64 oracle comparison; Inkling2-mini, batch 2, sequence 64,
  float64, packed rows) at each CP size, in two modes: sequential (run the
  case, then judge it: the ranks idle while the test process judges) and
  pipelined (``CaseRunner.run_many``: the oracle runs while the ranks work and
  the next cases are queued on the ranks while one is judged); per case where
  the time goes (ranks, pool transport, oracle, comparison) and the overlap
  gained (the parts' sum minus the wall time per case); the pool's own floor
  (a case that only all-reduces one number); and the naive way: a fresh
  ``torchrun`` per case (start a 2-rank pool, run the case, judge it, shut the
  pool down), each followed by at least as long of warm 2-rank cases in each
  mode, so that the rates are sampled under the same load. The ratio of the
  pipelined warm rate to the fresh rate at 2 ranks is the number the target
  is about.
- **communication**: for a grid of cases of every documented collective
  function (``convolution_history`` over widths, CP sizes and local lengths,
  both gathers in both float dtypes, differentiable and not, plus integer and
  bool payloads, ``shifted_cp_loss``), the bytes each rank sent and received
  (counted at the dispatcher by ``cp_harness.instruments.comm_meter``)
  against the analytic minimum of that call (``cp_harness.judging.comm_minimum``),
  payload and validation control messages apart.
- **memory**: per-rank peak tensor memory and saved-activation bytes of the
  miniature model's forward and backward on a long sequence at several CP
  sizes (check ``bench_memory``).
- **suite**: examples run and wall time of the full CPU test command.

It prints one table per section and a targets table (measured vs target,
PASS or MISS with the factor) and writes everything as JSON. The exit status
is 1 when a case fails its check (or ``--fail-on-miss`` and a target is
missed), else 0. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from cp_harness.verify import json_safe

DEFAULT_JSON = "reports/bench.json"
ROOT = Path(__file__).resolve().parents[2]

# The limits. They are not loosened here: a miss is reported with its factor.
TARGET_WARM_OVER_FRESH = 300.0
TARGET_COMM_RATIO = 1.0
TARGET_SUITE_SECONDS = 180.0
TARGET_SUITE_EXAMPLES = 1000

STANDARD_LAYOUT = {"format": "thd", "seq_len": 64,
                   "docs": [[[20, 22], [30, 30], [10, 12]], [[40, 41], [15, 15]]]}


def standard_case(seed: int, world_size: int) -> dict:
    """The standard throughput case: Inkling2-mini forward and backward, batch 2, sequence 64, float64.

    Two packed rows (documents with per-document padding, tail padding in the
    second row), so the layout hook, the convolution halo, both gathers and
    the loss reduction all run.
    """
    return {"check": "model", "world_size": int(world_size), "seed": int(seed), "model": "inkling2",
            "dtype": "float64", "batch": json.loads(json.dumps(STANDARD_LAYOUT)), "num_chunks": 1}


def memory_case(world_size: int, seq_len: int, dtype: str) -> dict:
    """One row of ``seq_len`` tokens packed with three documents (a quarter, a half, the rest)."""
    quarter = seq_len // 4
    docs = [[quarter, quarter], [2 * quarter, 2 * quarter], [seq_len - 3 * quarter, seq_len - 3 * quarter]]
    return {"check": "bench_memory", "world_size": int(world_size), "seed": 0, "model": "inkling2", "dtype": dtype,
            "batch": {"format": "thd", "seq_len": int(seq_len), "docs": [docs]}, "num_chunks": 1}


# ------------------------------------------------------------------ command line
def _sizes(text: str) -> tuple[int, ...]:
    from cp_harness.cases.descriptions import parse_world_sizes

    try:
        return parse_world_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp_harness bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path", default=DEFAULT_JSON, metavar="PATH",
                   help=f"where to write the JSON report (default {DEFAULT_JSON})")
    p.add_argument("--quick", action="store_true",
                   help="small counts and a small grid (the smoke test); numbers are then only indicative")
    p.add_argument("--impl", default=None, help="module exposing inkling2 and mistral_large4 (default: $CP_IMPL or cp_impl)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--skip-throughput", action="store_true", help="leave out the warm-pool throughput section")
    p.add_argument("--skip-fresh", action="store_true", help="leave out the fresh-torchrun-per-case baseline")
    p.add_argument("--skip-comm", action="store_true", help="leave out the communication section")
    p.add_argument("--skip-memory", action="store_true", help="leave out the memory section")
    p.add_argument("--skip-suite", action="store_true", help="leave out the full CPU test command")
    p.add_argument("--warm-cases", type=int, default=None,
                   help="timed warm cases per CP size (default 60; quick 6); at N=2 with the fresh baseline, at least "
                        "as many as fit in the time the fresh torchruns took")
    p.add_argument("--warmup-cases", type=int, default=None, help="untimed warm-up cases per CP size (default 3; quick 1)")
    p.add_argument("--fresh-cases", type=int, default=None, help="fresh-torchrun cases (default 3; quick 1)")
    p.add_argument("--throughput-sizes", type=_sizes, default=None,
                   help="CP sizes of the warm throughput (default 1,2,4,8; 1 is the no-collective reference; quick 2)")
    p.add_argument("--comm-repeats", type=int, default=1, help="runs of the communication grid (counts must not vary)")
    p.add_argument("--memory-sizes", type=_sizes, default=None, help="CP sizes of the memory section (default 1,2,4; quick 1,2)")
    p.add_argument("--memory-seq-len", type=int, default=None, help="tokens of the memory case (default 4096; quick 256)")
    p.add_argument("--memory-dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--suite-cmd", default="./scripts/test",
                   help="the full CPU test command, run from the repository root (default ./scripts/test)")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a target is missed")
    return p


def _settle(args: argparse.Namespace) -> argparse.Namespace:
    q = args.quick
    defaults = {"warm_cases": 6 if q else 60, "warmup_cases": 1 if q else 3, "fresh_cases": 1 if q else 3,
                "throughput_sizes": (2,) if q else (1, 2, 4, 8), "memory_sizes": (1, 2) if q else (1, 2, 4),
                "memory_seq_len": 256 if q else 4096}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("warm_cases", "fresh_cases", "comm_repeats"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be at least 1")
    return args


# ------------------------------------------------------------------ printing
def _log(message: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def format_table(headers: list[str], rows: list[list[Any]], title: str | None = None) -> str:
    """A plain text table; first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))

    out = [title, "=" * len(title)] if title else []
    out += [line(cells[0]), "-" * len(line(cells[0]))]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == float("inf"):
            return "inf"
        return f"{value:.3g}" if abs(value) < 0.01 and value != 0 else f"{value:,.2f}"
    return str(value)


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


# ------------------------------------------------------------------ throughput
def _judge(pool, case: dict, *, timeout: float | None = None):
    """Run and evaluate one case on ``pool`` (the runner's counters are left alone); a failure raises."""
    from cp_harness import checks
    from cp_harness.runner import failure_message

    report = checks.evaluate(case, pool.run(case, timeout=timeout))
    if not report.ok:
        raise BenchCaseFailed(failure_message(case, report, pool.config.impl, backend=pool.config.backend))
    return report


def _run_warm(pool, cases: list[dict]) -> list[dict]:
    """Sequential mode (as before the overlap): run each case, then judge it (oracle, then comparison).

    One timing record per case; a failing case raises. ``ranks``: the slowest rank's time on the case;
    ``transport``: the request's and the reply's way (``ranks.tickets.TicketQueue._timing``);
    ``oracle``: ``checks.expect``; ``compare``: ``checks.evaluate`` given the oracle's result.
    """
    from cp_harness import checks
    from cp_harness.runner import failure_message

    records = []
    for case in cases:
        started = time.perf_counter()
        ticket = pool.submit(case)
        outputs = pool.collect(ticket)
        ran = time.perf_counter()
        expected = checks.expect(case)
        expected_at = time.perf_counter()
        report = checks.evaluate(case, outputs, expected)
        judged = time.perf_counter()
        if not report.ok:
            raise BenchCaseFailed(failure_message(case, report, pool.config.impl, backend=pool.config.backend))
        records.append({"wall": judged - started, "run": ran - started, "ranks": ticket.timing["ranks"],
                        "collective_calls": max(len(o.comm) for o in outputs),
                        "transport": ticket.timing["transport"], "oracle": expected_at - ran,
                        "compare": judged - expected_at})
    return records


def _run_pipelined(runner, cases: Iterable[dict]) -> tuple[list[dict], float]:
    """Pipelined mode: ``CaseRunner.run_many`` (the oracle while the ranks run, the next cases queued on the
    ranks while one is judged). Same work per case as ``_run_warm`` (no excess judge, not counted).

    Returns one timing record per case and the wall time of the whole batch (per-case walls overlap).
    """
    from cp_harness.runner import failure_message

    records = []
    started = time.perf_counter()
    for report in runner.run_many(cases, excess=False, count=False):
        if not report.ok:
            raise BenchCaseFailed(failure_message(report.case, report, runner.config.impl,
                                                  backend=runner.config.backend))
        t = report.timing
        records.append({"ranks": t["ranks"], "transport": t["transport"], "oracle": t["oracle"],
                        "compare": t["compare"], "collective_calls": max(len(c["calls"]) for c in report.comm)})
    return records, time.perf_counter() - started


def _run_fresh(case: dict, impl: str, backend: str) -> dict:
    """The naive way: a new ``torchrun`` for this one case, then judge it and shut it down."""
    from cp_harness import checks
    from cp_harness.ranks.pool import PoolConfig, RankPool
    from cp_harness.runner import failure_message

    started = time.perf_counter()
    pool = RankPool(PoolConfig(world_size=int(case["world_size"]), backend=backend, impl=impl, launcher="torchrun"))
    try:
        pool.start()
        up = time.perf_counter()
        outputs = pool.run(case)
        ran = time.perf_counter()
        report = checks.evaluate(case, outputs)
        judged = time.perf_counter()
    finally:
        pool.close()
        pool.cleanup_workdir()
    closed = time.perf_counter()
    if not report.ok:
        raise BenchCaseFailed(failure_message(case, report, impl, backend=backend))
    return {"wall": closed - started, "start": up - started, "run": ran - up, "evaluate": judged - ran,
            "close": closed - judged}


PARTS = ("ranks", "transport", "oracle", "compare")


def _summarise_warm(records: list[dict], total: float | None = None, *, mode: str = "sequential") -> dict:
    """Rate and per-case breakdown. ``total``: the batch's wall time (pipelined); default the sum of per-case walls.

    ``overlap_gained_ms``: per case, the sum of the parts minus the wall time per case: what ran at the same
    time as something else (about 0 when sequential)."""
    if total is None:
        total = sum(r["wall"] for r in records)
    parts = {k: sum(r[k] for r in records) for k in PARTS}
    n = len(records)
    walls = [r["wall"] for r in records if "wall" in r]
    return {"mode": mode, "cases": n, "seconds": total, "cases_per_second": n / total if total else None,
            "mean_ms": 1000 * total / n, "median_ms": 1000 * statistics.median(walls) if walls else None,
            "breakdown_ms": {k: 1000 * v / n for k, v in parts.items()},
            "overlap_gained_ms": 1000 * (sum(parts.values()) - total) / n,
            "collective_calls_per_rank": max(r.get("collective_calls", 0) for r in records),
            "breakdown_share": {k: v / total if total else None for k, v in parts.items()}}


def _merge(batches: list[tuple[list[dict], float]]) -> tuple[list[dict], float]:
    return [r for records, _ in batches for r in records], sum(seconds for _, seconds in batches)


def bench_throughput(runner, args, impl: str, backend: str) -> dict:
    """Warm rate per CP size, sequential and pipelined; the fresh-torchrun baseline interleaved at 2 ranks.

    The warm rate of the ratio is the pipelined one (``CaseRunner.run_many``, as the test runs and golden
    files use it): each fresh torchrun is followed by at least as long of pipelined cases and as long of
    sequential ones, so that all three rates are sampled under the same load.
    """
    result: dict[str, Any] = {"case": standard_case(0, 2), "warm": {}, "sequential": {}, "floor": {}, "fresh": None,
                              "warm_mode": "pipelined (CaseRunner.run_many: oracle while the ranks run, next cases "
                                           "queued on the ranks)"}
    fresh_records: list[dict] = []
    for n in args.throughput_sizes:
        seeds = iter(range(1000 * n, 1000 * n + 100000))
        warmup = [standard_case(next(seeds), n) for _ in range(args.warmup_cases)]
        _run_warm(runner.pool, warmup)
        _run_pipelined(runner, [standard_case(next(seeds), n) for _ in range(args.warmup_cases)])
        cases = [standard_case(next(seeds), n) for _ in range(args.warm_cases)]
        interleave = n == 2 and not args.skip_fresh
        _log(f"throughput: {len(cases)} warm cases at N={n}, sequential and pipelined each" + (
            f", {args.fresh_cases} fresh torchruns interleaved, each followed by as long of warm cases in each mode"
            if interleave else ""))
        load_before = os.getloadavg()
        sequential: list[dict] = []
        pipelined: list[tuple[list[dict], float]] = []
        chunks = _split(cases, args.fresh_cases if interleave else 1)
        for index, chunk in enumerate(chunks):
            budget = 0.0
            if interleave:
                # Time-matched sampling: after each fresh torchrun, warm cases for at least as long (in
                # each mode), so that the rates are measured under the same (here: shared, noisy) load.
                fresh = _run_fresh(standard_case(500_000 + index, 2), impl, backend)
                fresh_records.append(fresh)
                budget = fresh["wall"]
            pipelined.append(_run_pipelined(runner, _until(list(chunk), budget, seeds, n)))
            spent = 0.0
            pending = [standard_case(next(seeds), n) for _ in chunk]
            while pending or spent < budget:
                record = _run_warm(runner.pool, [pending.pop(0) if pending else standard_case(next(seeds), n)])[0]
                sequential.append(record)
                spent += record["wall"]
        records, total = _merge(pipelined)
        summary = _summarise_warm(records, total, mode="pipelined")
        summary["load_average"] = [load_before[0], os.getloadavg()[0]]
        result["warm"][str(n)] = summary
        result["sequential"][str(n)] = _summarise_warm(sequential, mode="sequential")
        # The pool's own floor at this size: a case that only all-reduces one number.
        floor_cases = [{"check": "pool_selftest", "world_size": n, "seed": i, "mode": "ok"}
                       for i in range(max(args.warm_cases // 2, 1))]
        result["floor"][str(n)] = _summarise_warm(_run_warm(runner.pool, floor_cases))
    if fresh_records:
        total = sum(r["wall"] for r in fresh_records)
        result["fresh"] = {"world_size": 2, "cases": len(fresh_records), "seconds": total,
                           "cases_per_second": len(fresh_records) / total,
                           "mean_s": {k: statistics.mean(r[k] for r in fresh_records)
                                      for k in ("wall", "start", "run", "evaluate", "close")},
                           "records": fresh_records}
    result["oracle_threads"] = _oracle_thread_probe(max(args.warm_cases // 2, 4))
    warm2, seq2 = result["warm"].get("2"), result["sequential"].get("2")
    if warm2 and result["fresh"]:
        result["warm_over_fresh_2"] = warm2["cases_per_second"] / result["fresh"]["cases_per_second"]
        result["sequential_over_fresh_2"] = seq2["cases_per_second"] / result["fresh"]["cases_per_second"]
    return result


def _until(cases: list[dict], seconds: float, seeds: Iterator[int], n: int) -> Iterator[dict]:
    """``cases``, then more standard cases until ``seconds`` have passed since the first was asked for."""
    started = time.perf_counter()
    yield from cases
    while time.perf_counter() - started < seconds:
        yield standard_case(next(seeds), n)


def _oracle_thread_probe(repeats: int) -> dict:
    """The standard case's oracle with torch's default intra-op threads and with one, interleaved.

    ``checks.evaluate`` runs the oracle with one thread; this records, in the same
    run, what the default would cost on this machine (see ``docs/benchmarks.md``).
    """
    import torch
    from cp_harness.checks import models

    default = torch.get_num_threads()
    times: dict[int, list[float]] = {default: [], 1: []}
    try:
        for i in range(repeats):
            for threads in times:
                torch.set_num_threads(threads)
                started = time.perf_counter()
                models.oracle_run(standard_case(900_000 + i, 2))
                times[threads].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(default)
    out = {}
    for threads, values in times.items():
        values.sort()
        out[f"threads={threads}"] = {"mean_ms": 1000 * statistics.mean(values),
                                     "median_ms": 1000 * statistics.median(values), "max_ms": 1000 * values[-1]}
    return {"default_threads": default, "repeats": repeats, "results": out}


def _split(items: list, parts: int) -> list[list]:
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def throughput_tables(result: dict) -> str:
    rows = []
    sizes = list(result["warm"])
    for n in sizes:
        for label, s in (("sequential: run, then judge", result.get("sequential", {}).get(n)),
                         ("pipelined: judged while the next run", result["warm"][n])):
            if s is None:
                continue
            b = s["breakdown_ms"]
            rows.append([f"warm pool, N={n}, {label}" + (" (no collectives)" if n == "1" else ""), s["cases"],
                         s["cases_per_second"], s["mean_ms"], s["median_ms"], s["collective_calls_per_rank"],
                         b["ranks"], b["transport"], b["oracle"], b["compare"], s["overlap_gained_ms"]])
    for n, s in result.get("floor", {}).items():
        b = s["breakdown_ms"]
        rows.append([f"  pool floor, N={n} (one all_reduce)", s["cases"], s["cases_per_second"], s["mean_ms"],
                     s["median_ms"], s["collective_calls_per_rank"], b["ranks"], b["transport"], None, b["compare"],
                     None])
    fresh = result.get("fresh")
    if fresh:
        m = fresh["mean_s"]
        rows.append(["fresh torchrun per case, N=2", fresh["cases"], fresh["cases_per_second"], 1000 * m["wall"], None,
                     None, 1000 * m["run"], f"start {1000 * m['start']:,.0f} + close {1000 * m['close']:,.0f}",
                     1000 * m["evaluate"], None, None])
    text = format_table(["standard case (Inkling2-mini fwd+bwd, B=2, S=64, float64)", "cases", "cases/s", "mean ms",
                         "median ms", "collectives", "ranks ms", "transport ms", "oracle ms", "compare ms",
                         "overlap gained ms"], rows,
                        title="Harness throughput (per case; overlap gained = ranks + transport + oracle + compare "
                              "- wall per case)")
    probe = result.get("oracle_threads")
    if probe and len(probe["results"]) > 1:
        text += "\noracle of the standard case by intra-op threads (mean / median / max ms): " + "; ".join(
            f"{k}: {v['mean_ms']:.1f} / {v['median_ms']:.1f} / {v['max_ms']:.1f}" for k, v in probe["results"].items())
    if "warm_over_fresh_2" in result:
        text += (f"\nwarm pool / fresh torchrun at N=2: {result['warm_over_fresh_2']:,.1f}x with the pipelined warm "
                 f"rate (the one the target uses); {result['sequential_over_fresh_2']:,.1f}x with the sequential one")
    return text


# ------------------------------------------------------------------ communication
def comm_grid(quick: bool) -> list[tuple[str, str, dict]]:
    """``(function, detail, case)`` for every collective function the API documents."""
    grid: list[tuple[str, str, dict]] = []
    seed = 0
    halo_sizes = (2, 3) if quick else (2, 3, 4, 8)
    halo_widths = (2, 9) if quick else (2, 4, 9, 17)
    for local in (4, 16):
        for n in halo_sizes:
            for width in halo_widths:
                seed += 1
                grid.append(("inkling2.convolution_history", f"N={n} W={width} L={local}",
                             {"check": "convolution_history", "world_size": n, "seed": seed, "dtype": "float64",
                              "shape": [2, local, 3], "width": width}))
    gather_sizes = (2, 3) if quick else (2, 4, 8)
    for function, check, shape in (("inkling2.gather_sequence", "gather_sequence", [2, 5, 3]),
                                   ("mistral_large4.gather_tokens", "gather_tokens", [5, 3])):
        for n in gather_sizes:
            for dtype in ("float64", "float32"):
                for differentiable in (True, False):
                    seed += 1
                    grid.append((function, f"N={n} {dtype} differentiable={differentiable}",
                                 {"check": check, "world_size": n, "seed": seed, "dtype": dtype, "shape": shape,
                                  "differentiable": differentiable}))
            for value_dtype in ("int64", "bool"):
                seed += 1
                grid.append((function, f"N={n} {value_dtype}",
                             {"check": check, "world_size": n, "seed": seed, "dtype": "float64", "shape": shape,
                              "differentiable": False, "value_dtype": value_dtype}))
    loss_sizes = (2, 3) if quick else (2, 3, 4, 8)
    layouts = ({"format": "thd", "seq_len": 24, "docs": [[[7, 8], [10, 10], [3, 4]], [[20, 22]]]},
               {"format": "bshd", "seq_len": 21, "rows": [[0, 21], [4, 12], [0, 0]]})
    for n in loss_sizes:
        for spec in layouts:
            seed += 1
            grid.append(("mistral_large4.shifted_cp_loss", f"N={n} {spec['format']} B={len(spec.get('docs', spec.get('rows')))}",
                         {"check": "shifted_cp_loss", "world_size": n, "seed": seed, "model": "mistral_large4",
                          "dtype": "float64", "vocab": 11, "batch": spec}))
    return grid


def _ratio(moved: int, need: int) -> float:
    if need == 0:
        return 1.0 if moved == 0 else float("inf")
    return moved / need


def bench_comm(runner, args) -> dict:
    from cp_harness.judging import comm_minimum

    grid = comm_grid(args.quick)
    _log(f"communication: {len(grid)} cases x {args.comm_repeats}")
    cases_out = []
    for repeat in range(args.comm_repeats):
        for function, detail, case in grid:
            report = _judge(runner.pool, case)
            moved = comm_minimum.per_rank_moved(report)
            need = comm_minimum.per_rank_minimum(case)
            entry = {"function": function, "detail": detail, "case": case, "world_size": case["world_size"],
                     "sent": [m["sent"] for m in moved], "recv": [m["recv"] for m in moved],
                     "min_sent": [s for s, _ in need], "min_recv": [r for _, r in need],
                     "control_sent": [m["control_sent"] for m in moved],
                     "control_recv": [m["control_recv"] for m in moved],
                     "collective_calls": [m["calls"] for m in moved], "repeat": repeat}
            entry["ratio"] = _ratio(sum(entry["sent"]), sum(entry["min_sent"]))
            entry["worst_rank_ratio_sent"] = max(_ratio(a, b) for a, b in zip(entry["sent"], entry["min_sent"]))
            entry["worst_rank_ratio_recv"] = max(_ratio(a, b) for a, b in zip(entry["recv"], entry["min_recv"]))
            entry["best_rank_ratio"] = min(min(_ratio(a, b) for a, b in zip(entry["sent"], entry["min_sent"])),
                                           min(_ratio(a, b) for a, b in zip(entry["recv"], entry["min_recv"])))
            cases_out.append(entry)
    functions: dict[str, dict] = {}
    for e in cases_out:
        f = functions.setdefault(e["function"], {"cases": 0, "sent": 0, "min_sent": 0, "recv": 0, "min_recv": 0,
                                                 "control_sent": 0, "worst_rank_ratio_sent": 0.0,
                                                 "worst_rank_ratio_recv": 0.0, "best_rank_ratio": float("inf"),
                                                 "control_calls": 0, "control_bytes_per_peer": 0})
        f["cases"] += 1
        for key in ("sent", "min_sent", "recv", "min_recv", "control_sent"):
            f[key] += sum(e[key])
        f["control_calls"] += sum(1 for c in e["control_sent"] if c)
        f["control_bytes_per_peer"] = max([f.get("control_bytes_per_peer", 0)]
                                          + [c // (e["world_size"] - 1) for c in e["control_sent"] if c])
        f["worst_rank_ratio_sent"] = max(f["worst_rank_ratio_sent"], e["worst_rank_ratio_sent"])
        f["worst_rank_ratio_recv"] = max(f["worst_rank_ratio_recv"], e["worst_rank_ratio_recv"])
        f["best_rank_ratio"] = min(f["best_rank_ratio"], e["best_rank_ratio"])
    for f in functions.values():
        f["ratio_sent"] = _ratio(f["sent"], f["min_sent"])
        f["ratio_recv"] = _ratio(f["recv"], f["min_recv"])
    halo: dict[str, dict] = {}
    for e in cases_out:
        if e["function"] != "inkling2.convolution_history" or e["repeat"]:
            continue
        n, w, L = e["case"]["world_size"], e["case"]["width"], e["case"]["shape"][1]
        h = halo.setdefault(f"N={n} W={w}", {"world_size": n, "width": w})
        h[f"L={L}"] = {"ratio_sent": _ratio(sum(e["sent"]), sum(e["min_sent"])),
                       "ratio_recv": _ratio(sum(e["recv"]), sum(e["min_recv"])),
                       "worst_rank_ratio": max(e["worst_rank_ratio_sent"], e["worst_rank_ratio_recv"]),
                       "payload_sent": sum(e["sent"]), "control_sent": sum(e["control_sent"]),
                       "history_spans_ranks": w - 1 > L}
    all_ratios = [r for f in functions.values() for r in (f["worst_rank_ratio_sent"], f["worst_rank_ratio_recv"],
                                                          f["ratio_sent"], f["ratio_recv"])]
    return {"cases": cases_out, "functions": functions, "halo": halo,
            "max_ratio": max(all_ratios) if all_ratios else None,
            "min_ratio": min([f["best_rank_ratio"] for f in functions.values()] + all_ratios) if all_ratios else None,
            "repeats_agree": _repeats_agree(cases_out, args.comm_repeats)}


def _repeats_agree(cases: list[dict], repeats: int) -> bool:
    if repeats < 2:
        return True
    key = lambda e: (e["function"], e["detail"])  # noqa: E731
    first = {key(e): (e["sent"], e["recv"]) for e in cases if e["repeat"] == 0}
    return all(first[key(e)] == (e["sent"], e["recv"]) for e in cases)


def comm_tables(result: dict) -> str:
    rows = []
    for name, f in result["functions"].items():
        rows.append([name, f["cases"], f["sent"], f["min_sent"], f["ratio_sent"], f["recv"], f["min_recv"],
                     f["ratio_recv"], max(f["worst_rank_ratio_sent"], f["worst_rank_ratio_recv"]),
                     f["control_sent"], f["control_bytes_per_peer"]])
    text = format_table(["function", "cases", "sent B", "min sent B", "sent/min", "recv B", "min recv B", "recv/min",
                         "worst rank", "control B", "ctl B/peer/call"], rows,
                        title="Communication: payload bytes against the analytic minimum (control apart)")
    halo_rows = []
    for key, h in result["halo"].items():
        row = [key]
        for L in ("L=4", "L=16"):
            cell = h.get(L)
            row += [None, None] if cell is None else [cell["ratio_sent"], cell["worst_rank_ratio"]]
        halo_rows.append(row)
    text += "\n\n" + format_table(["convolution_history", "L=4 ratio", "L=4 worst rank", "L=16 ratio",
                                   "L=16 worst rank"], halo_rows, title="Halo ratio per (N, W)")
    worst = sorted(result["cases"], key=lambda e: -max(e["worst_rank_ratio_sent"], e["worst_rank_ratio_recv"]))[:3]
    text += "\nlargest per-rank ratios: " + "; ".join(
        f"{e['function']} {e['detail']}: {max(e['worst_rank_ratio_sent'], e['worst_rank_ratio_recv']):.2f}" for e in worst)
    return text


# ------------------------------------------------------------------ memory
def bench_memory(runner, args) -> dict:
    rows = {}
    for n in sorted(args.memory_sizes):
        case = memory_case(n, args.memory_seq_len, args.memory_dtype)
        _log(f"memory: {args.memory_seq_len} tokens at N={n}")
        started = time.perf_counter()
        report = _judge(runner.pool, case, timeout=max(runner.config.case_timeout, 900.0))
        per_rank = report.info["per_rank"]
        rows[str(n)] = {"per_rank": per_rank, "seconds": time.perf_counter() - started,
                        "peak_bytes_max": max(r["peak_bytes"] for r in per_rank),
                        "forward_peak_bytes_max": max(r["forward_peak_bytes"] for r in per_rank),
                        "saved_bytes_max": max(r["saved_bytes"] for r in per_rank)}
        if "cuda_peak_bytes" in per_rank[0]:
            rows[str(n)]["cuda_peak_bytes_max"] = max(r["cuda_peak_bytes"] for r in per_rank)
    base = rows.get("1")
    for n, row in rows.items():
        if base:
            row["peak_vs_n1"] = row["peak_bytes_max"] / base["peak_bytes_max"]
            row["saved_vs_n1"] = row["saved_bytes_max"] / base["saved_bytes_max"]
    peaks = [rows[k]["peak_bytes_max"] for k in sorted(rows, key=int)]
    return {"seq_len": args.memory_seq_len, "batch": 1, "dtype": args.memory_dtype, "model": "inkling2",
            "case": memory_case(1, args.memory_seq_len, args.memory_dtype), "sizes": rows,
            "falls_with_cp": all(a > b for a, b in zip(peaks, peaks[1:]))}


def memory_tables(result: dict) -> str:
    rows = []
    for n, r in sorted(result["sizes"].items(), key=lambda kv: int(kv[0])):
        rows.append([f"N={n}", _mib(r["forward_peak_bytes_max"]), _mib(r["peak_bytes_max"]), r.get("peak_vs_n1"),
                     1 / int(n), _mib(r["saved_bytes_max"]), r.get("saved_vs_n1"),
                     _mib(r["cuda_peak_bytes_max"]) if "cuda_peak_bytes_max" in r else None])
    return format_table(["CP size", "fwd peak MiB", "fwd+bwd peak MiB", "peak / N=1", "1/N", "saved for bwd MiB",
                         "saved / N=1", "CUDA peak MiB"], rows,
                        title=f"Memory per rank: Inkling2-mini fwd+bwd, batch 1, {result['seq_len']} tokens, "
                              f"{result['dtype']} (largest rank)")


# ------------------------------------------------------------------ suite
_PASSED = re.compile(r"(\d+) passed")
_FAILED = re.compile(r"(\d+) (failed|error|errors)\b")
_EXAMPLES = re.compile(r"CP examples run: (\d+)(?: \(([^)]*)\))?")
_PYTEST_TIME = re.compile(r" in ([\d.]+)s")


def bench_suite(command: str) -> dict:
    _log(f"suite: running {command!r} (the full CPU test command)")
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(command, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    out = proc.stdout
    passed = _PASSED.findall(out)
    failed = sum(int(m[0]) for m in _FAILED.findall(out.splitlines()[-1] if out.strip() else ""))
    examples = _EXAMPLES.findall(out)
    timing = _PYTEST_TIME.findall(out.splitlines()[-1] if out.strip() else "")
    return {"command": command, "returncode": proc.returncode, "seconds": seconds,
            "pytest_seconds": float(timing[-1]) if timing else None,
            "passed": int(passed[-1]) if passed else 0, "failed": failed,
            "cp_examples": int(examples[-1][0]) if examples else 0,
            "cp_examples_per_size": examples[-1][1] if examples else None,
            "load_average": [load_before, os.getloadavg()[0]],
            "output_tail": out[-4000:]}


def suite_table(result: dict) -> str:
    return format_table(["command", "exit", "passed", "failed", "CP examples", "per CP size", "wall s", "pytest s"],
                        [[result["command"], result["returncode"], result["passed"], result["failed"],
                          result["cp_examples"], result["cp_examples_per_size"], result["seconds"],
                          result["pytest_seconds"]]], title="Full CPU test suite")


# ------------------------------------------------------------------ targets
def targets(report: dict) -> list[dict]:
    """Measured against the issue's targets; ``factor`` > 1 means better than the target by that much."""
    out = []
    tp = report.get("throughput") or {}
    if "warm_over_fresh_2" in tp:
        ratio = tp["warm_over_fresh_2"]
        out.append({"name": "warm pool / fresh torchrun, N=2", "measured": ratio, "target": f">= {TARGET_WARM_OVER_FRESH:g}x",
                    "ok": ratio >= TARGET_WARM_OVER_FRESH, "factor": ratio / TARGET_WARM_OVER_FRESH})
    comm = report.get("communication")
    if comm and comm.get("functions"):
        for name, f in comm["functions"].items():
            worst = max(f["worst_rank_ratio_sent"], f["worst_rank_ratio_recv"], f["ratio_sent"], f["ratio_recv"])
            best = min(f["best_rank_ratio"], f["ratio_sent"], f["ratio_recv"])
            ok = abs(worst - TARGET_COMM_RATIO) < 1e-12 and abs(best - TARGET_COMM_RATIO) < 1e-12
            out.append({"name": f"comm ratio {name}", "measured": worst, "target": "= 1.00 (every rank, sent and received)",
                        "ok": ok, "factor": TARGET_COMM_RATIO / worst if worst else None})
    suite = report.get("suite")
    if suite and not suite.get("skipped"):
        out.append({"name": "full CPU test command, wall", "measured": suite["seconds"],
                    "target": f"< {TARGET_SUITE_SECONDS:g} s",
                    "ok": suite["seconds"] < TARGET_SUITE_SECONDS and suite["returncode"] == 0,
                    "factor": TARGET_SUITE_SECONDS / suite["seconds"] if suite["seconds"] else None})
        out.append({"name": "CP examples in the suite", "measured": suite["cp_examples"],
                    "target": f">= {TARGET_SUITE_EXAMPLES}", "ok": suite["cp_examples"] >= TARGET_SUITE_EXAMPLES,
                    "factor": suite["cp_examples"] / TARGET_SUITE_EXAMPLES})
    memory = report.get("memory")
    if memory:
        out.append({"name": "memory per rank falls as N grows", "measured": memory["falls_with_cp"],
                    "target": "falls", "ok": bool(memory["falls_with_cp"]), "factor": None})
    return out


def targets_table(rows: list[dict]) -> str:
    body = []
    for t in rows:
        factor = t["factor"]
        if factor is None:
            status = "PASS" if t["ok"] else "MISS"
        elif t["ok"]:
            status = f"PASS ({factor:.2f}x the target)"
        elif factor >= 1:
            status = f"MISS (factor {factor:.2f})"
        else:
            status = f"MISS (at {factor:.2f} of the target: {1 / factor:.2f}x short)" if factor else "MISS"
        body.append([t["name"], t["measured"], t["target"], status])
    return format_table(["target", "measured", "limit", "status"], body, title="Targets")


# ------------------------------------------------------------------ main
class BenchCaseFailed(AssertionError):
    """A benchmark case failed its check: the numbers of a wrong implementation mean nothing."""


def _environment(impl: str, backend: str) -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "impl": impl, "backend": backend,
            "load_average_start": list(os.getloadavg()),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run_bench(args: argparse.Namespace, stream=sys.stdout, runner=None) -> tuple[int, dict]:
    """Run the selected sections; returns ``(exit code, report)`` and writes ``args.json_path``.

    ``runner``: an already warm ``CaseRunner`` to use instead of starting a pool
    (the smoke test passes the test session's); it is used only when it has
    enough ranks and runs the selected implementation, and it is left open.
    """
    from cp_harness.cases.implementation import selected_impl_name
    from cp_harness.ranks.pool import PoolConfig, RankFailure
    from cp_harness.runner import CaseRunner

    impl = selected_impl_name(args.impl)
    started = time.perf_counter()
    report: dict[str, Any] = {"version": 1, "quick": bool(args.quick), "environment": _environment(impl, args.backend),
                              "targets_spec": {"warm_over_fresh_2": TARGET_WARM_OVER_FRESH, "comm_ratio": TARGET_COMM_RATIO,
                                               "suite_seconds": TARGET_SUITE_SECONDS,
                                               "suite_examples": TARGET_SUITE_EXAMPLES}}
    sizes = set()
    if not args.skip_throughput:
        sizes |= set(args.throughput_sizes)
    if not args.skip_comm:
        sizes |= {c["world_size"] for _, _, c in comm_grid(args.quick)}
    if not args.skip_memory:
        sizes |= set(args.memory_sizes)
    code = 0
    if sizes:
        shared = runner is not None and runner.config.world_size >= max(sizes) and runner.config.impl == impl \
            and runner.config.backend == args.backend
        if not shared:
            runner = CaseRunner(PoolConfig(world_size=max(sizes), backend=args.backend, impl=impl))
        t = time.perf_counter()
        _log(f"using the caller's warm pool of {runner.config.world_size} ranks" if shared
             else f"starting a warm pool of {max(sizes)} ranks")
        try:
            runner.pool.start()
            report["pool"] = {"world_size": runner.config.world_size, "start_seconds": time.perf_counter() - t,
                              "shared": shared}
            print(f"warm pool of {runner.config.world_size} ranks " + ("(already running)" if shared else
                  f"started in {report['pool']['start_seconds']:.1f} s") + " (not counted in the warm rates)\n",
                  file=stream)
            sections = [("throughput", args.skip_throughput, lambda: bench_throughput(runner, args, impl, args.backend),
                         throughput_tables),
                        ("communication", args.skip_comm, lambda: bench_comm(runner, args), comm_tables),
                        ("memory", args.skip_memory, lambda: bench_memory(runner, args), memory_tables)]
            for name, skip, run, show in sections:
                if skip:
                    report[name] = None
                    continue
                t = time.perf_counter()
                report[name] = run()
                report[name]["section_seconds"] = time.perf_counter() - t
                print(show(report[name]) + "\n", file=stream, flush=True)
        except (BenchCaseFailed, RankFailure) as exc:
            print(f"a benchmark case failed, so its numbers are not reported:\n{exc}", file=stream)
            code = 1
        finally:
            if not shared:
                runner.close()
    if not args.skip_suite and code == 0:
        report["suite"] = bench_suite(args.suite_cmd)
        print(suite_table(report["suite"]) + "\n", file=stream, flush=True)
    else:
        report["suite"] = {"skipped": True}
    report["targets"] = targets(report)
    report["seconds"] = time.perf_counter() - started
    report["environment"]["load_average_end"] = list(os.getloadavg())
    print(targets_table(report["targets"]), file=stream)
    print(f"\nbench took {report['seconds']:.1f} s; load average {report['environment']['load_average_start'][0]:.1f} "
          f"at start, {report['environment']['load_average_end'][0]:.1f} at end, {os.cpu_count()} CPUs", file=stream)
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(report), indent=2))
        print(f"JSON report written to {path}", file=stream)
    if code == 0 and args.fail_on_miss and not all(t["ok"] for t in report["targets"]):
        code = 1
    return code, report


def main(argv: list[str] | None = None) -> int:
    args = _settle(build_parser().parse_args(argv))
    code, _ = run_bench(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
