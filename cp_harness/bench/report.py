"""The benchmark's output: one text table per section and the JSON report.

The sections return plain dicts; everything a person reads is rendered here
from those dicts, so the JSON report and the printed tables show the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from cp_harness.bench.communication import HALO_FUNCTION
from cp_harness.judging.serialize import json_safe


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


def mib(nbytes: float) -> float:
    return nbytes / 2**20


def throughput_tables(result: dict) -> str:
    rows = []
    sizes = list(result["warm"])
    for n in sizes:
        for label, s in (
            ("sequential: run, then judge", result.get("sequential", {}).get(n)),
            ("pipelined: judged while the next run", result["warm"][n]),
        ):
            if s is None:
                continue
            b = s["breakdown_ms"]
            rows.append(
                [
                    f"warm pool, N={n}, {label}" + (" (no collectives)" if n == "1" else ""),
                    s["cases"],
                    s["cases_per_second"],
                    s["mean_ms"],
                    s["median_ms"],
                    s["collective_calls_per_rank"],
                    b["ranks"],
                    b["transport"],
                    b["oracle"],
                    b["compare"],
                    s["overlap_gained_ms"],
                ]
            )
    for n, s in result.get("floor", {}).items():
        b = s["breakdown_ms"]
        rows.append(
            [
                f"  pool floor, N={n} (one all_reduce)",
                s["cases"],
                s["cases_per_second"],
                s["mean_ms"],
                s["median_ms"],
                s["collective_calls_per_rank"],
                b["ranks"],
                b["transport"],
                None,
                b["compare"],
                None,
            ]
        )
    fresh = result.get("fresh")
    if fresh:
        m = fresh["mean_s"]
        rows.append(
            [
                "fresh torchrun per case, N=2",
                fresh["cases"],
                fresh["cases_per_second"],
                1000 * m["wall"],
                None,
                None,
                1000 * m["run"],
                f"start {1000 * m['start']:,.0f} + close {1000 * m['close']:,.0f}",
                1000 * m["evaluate"],
                None,
                None,
            ]
        )
    text = format_table(
        [
            "standard case (Inkling2-mini fwd+bwd, B=2, S=64, float64)",
            "cases",
            "cases/s",
            "mean ms",
            "median ms",
            "collectives",
            "ranks ms",
            "transport ms",
            "oracle ms",
            "compare ms",
            "overlap gained ms",
        ],
        rows,
        title="Harness throughput (per case; overlap gained = ranks + transport + oracle + compare - wall per case)",
    )
    probe = result.get("oracle_threads")
    if probe and len(probe["results"]) > 1:
        text += "\noracle of the standard case by intra-op threads (mean / median / max ms): " + "; ".join(
            f"{k}: {v['mean_ms']:.1f} / {v['median_ms']:.1f} / {v['max_ms']:.1f}" for k, v in probe["results"].items()
        )
    if "warm_over_fresh_2" in result:
        text += (
            f"\nwarm pool / fresh torchrun at N=2: {result['warm_over_fresh_2']:,.1f}x with the pipelined warm "
            f"rate (the one the target uses); {result['sequential_over_fresh_2']:,.1f}x with the sequential one"
        )
    return text


def comm_tables(result: dict) -> str:
    rows = []
    for name, f in result["functions"].items():
        rows.append(
            [
                name,
                f["cases"],
                f["sent"],
                f["min_sent"],
                f["ratio_sent"],
                f["recv"],
                f["min_recv"],
                f["ratio_recv"],
                max(f["worst_rank_ratio_sent"], f["worst_rank_ratio_recv"]),
                f["control_sent"],
                f["control_bytes_per_peer"],
            ]
        )
    text = format_table(
        [
            "function",
            "cases",
            "sent B",
            "min sent B",
            "sent/min",
            "recv B",
            "min recv B",
            "recv/min",
            "worst rank",
            "control B",
            "ctl B/peer/call",
        ],
        rows,
        title="Communication: payload bytes against the analytic minimum (control apart)",
    )
    halo_rows = []
    for key, h in result["halo"].items():
        row = [key]
        for L in ("L=4", "L=16"):
            cell = h.get(L)
            row += [None, None] if cell is None else [cell["ratio_sent"], cell["worst_rank_ratio"]]
        halo_rows.append(row)
    text += "\n\n" + format_table(
        [HALO_FUNCTION.rpartition(".")[2], "L=4 ratio", "L=4 worst rank", "L=16 ratio", "L=16 worst rank"],
        halo_rows,
        title="Halo ratio per (N, W)",
    )
    worst = sorted(result["cases"], key=lambda e: -max(e["worst_rank_ratio_sent"], e["worst_rank_ratio_recv"]))[:3]
    text += "\nlargest per-rank ratios: " + "; ".join(
        f"{e['function']} {e['detail']}: {max(e['worst_rank_ratio_sent'], e['worst_rank_ratio_recv']):.2f}"
        for e in worst
    )
    return text


def memory_tables(result: dict) -> str:
    rows = []
    for n, r in sorted(result["sizes"].items(), key=lambda kv: int(kv[0])):
        rows.append(
            [
                f"N={n}",
                mib(r["forward_peak_bytes_max"]),
                mib(r["peak_bytes_max"]),
                r.get("peak_vs_n1"),
                1 / int(n),
                mib(r["saved_bytes_max"]),
                r.get("saved_vs_n1"),
                mib(r["cuda_peak_bytes_max"]) if "cuda_peak_bytes_max" in r else None,
            ]
        )
    return format_table(
        [
            "CP size",
            "fwd peak MiB",
            "fwd+bwd peak MiB",
            "peak / N=1",
            "1/N",
            "saved for bwd MiB",
            "saved / N=1",
            "CUDA peak MiB",
        ],
        rows,
        title=f"Memory per rank: Inkling2-mini fwd+bwd, batch 1, {result['seq_len']} tokens, "
        f"{result['dtype']} (largest rank)",
    )


def suite_table(result: dict) -> str:
    return format_table(
        ["command", "exit", "passed", "failed", "CP examples", "per CP size", "wall s", "pytest s"],
        [
            [
                result["command"],
                result["returncode"],
                result["passed"],
                result["failed"],
                result["cp_examples"],
                result["cp_examples_per_size"],
                result["seconds"],
                result["pytest_seconds"],
            ]
        ],
        title="Full CPU test suite",
    ) + _where_the_time_goes(result)


def _where_the_time_goes(result: dict) -> str:
    """The suite's per-file and slowest-test tables, with the fresh-case equivalents when measured."""
    if not result.get("by_file"):
        return ""
    total = result["test_seconds_total"] or 1.0
    fce = result.get("fresh_case_equivalents")
    unit = f"; {fce:.1f} fresh 2-rank torchrun cases of pytest time" if fce else ""
    files = format_table(
        ["test file", "tests", "seconds", "share"],
        [[f, n, s, f"{100 * s / total:.1f}%"] for f, s, n in result["by_file"]],
        title=f"Where the suite's time goes, per test file ({total:.0f} test seconds over all workers{unit})",
    )
    slowest = format_table(["test", "seconds"], [[name, s] for name, s in result["slowest"]], title="Slowest tests")
    return "\n\n" + files + "\n\n" + slowest


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


def write_json(report: dict, path: str, stream: TextIO) -> None:
    """``report`` as strict, indented JSON at ``path`` (its folder created), and a line saying where."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(json_safe(report), indent=2))
    print(f"JSON report written to {target}", file=stream)
