"""The communication section: bytes each rank moved against the analytic minimum of each documented call.

A grid of cases covers every collective function the API documents
(``convolution_history`` over widths, CP sizes and local lengths, both gathers
in both float dtypes, differentiable and not, plus integer and bool payloads,
``shifted_cp_loss``). The bytes are counted at the dispatcher
(``cp_harness.instruments.comm_meter``) and compared with
``cp_harness.judging.comm_minimum``, payload and validation control messages apart.
"""

from __future__ import annotations

from typing import Any

from cp_harness.bench.options import BenchOptions
from cp_harness.bench.progress import log
from cp_harness.bench.timed_runs import judge_case
from cp_harness.checks import check_of, loss, transport

HALO_FUNCTION = "inkling2.convolution_history"


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
                grid.append(
                    (
                        HALO_FUNCTION,
                        f"N={n} W={width} L={local}",
                        {
                            "check": transport.CONVOLUTION_HISTORY.name,
                            "world_size": n,
                            "seed": seed,
                            "dtype": "float64",
                            "shape": [2, local, 3],
                            "width": width,
                        },
                    )
                )
    gather_sizes = (2, 3) if quick else (2, 4, 8)
    for function, check, shape in (
        ("inkling2.gather_sequence", transport.GATHER_SEQUENCE.name, [2, 5, 3]),
        ("mistral_large4.gather_tokens", transport.GATHER_TOKENS.name, [5, 3]),
    ):
        for n in gather_sizes:
            for dtype in ("float64", "float32"):
                for differentiable in (True, False):
                    seed += 1
                    grid.append(
                        (
                            function,
                            f"N={n} {dtype} differentiable={differentiable}",
                            {
                                "check": check,
                                "world_size": n,
                                "seed": seed,
                                "dtype": dtype,
                                "shape": shape,
                                "differentiable": differentiable,
                            },
                        )
                    )
            for value_dtype in ("int64", "bool"):
                seed += 1
                grid.append(
                    (
                        function,
                        f"N={n} {value_dtype}",
                        {
                            "check": check,
                            "world_size": n,
                            "seed": seed,
                            "dtype": "float64",
                            "shape": shape,
                            "differentiable": False,
                            "value_dtype": value_dtype,
                        },
                    )
                )
    loss_sizes = (2, 3) if quick else (2, 3, 4, 8)
    layouts: tuple[dict[str, Any], ...] = (
        {"format": "thd", "seq_len": 24, "docs": [[[7, 8], [10, 10], [3, 4]], [[20, 22]]]},
        {"format": "bshd", "seq_len": 21, "rows": [[0, 21], [4, 12], [0, 0]]},
    )
    for n in loss_sizes:
        for spec in layouts:
            seed += 1
            rows = len(spec["docs"] if "docs" in spec else spec["rows"])
            grid.append(
                (
                    "mistral_large4.shifted_cp_loss",
                    f"N={n} {spec['format']} B={rows}",
                    {
                        "check": loss.SHIFTED_CP_LOSS.name,
                        "world_size": n,
                        "seed": seed,
                        "model": "mistral_large4",
                        "dtype": "float64",
                        "vocab": 11,
                        "batch": spec,
                    },
                )
            )
    return grid


def ratio(moved: int, need: int) -> float:
    """Bytes moved over bytes needed; 1 when both are 0, infinite when bytes moved that were not needed."""
    if need == 0:
        return 1.0 if moved == 0 else float("inf")
    return moved / need


def measure(runner, options: BenchOptions) -> dict:
    """Every grid case ``options.comm_repeats`` times: per case, per function, and the halo per (N, W)."""
    grid = comm_grid(options.quick)
    log(f"communication: {len(grid)} cases x {options.comm_repeats}")
    cases_out = [
        _case_entry(runner, function, detail, case, repeat)
        for repeat in range(options.comm_repeats)
        for function, detail, case in grid
    ]
    functions = _per_function(cases_out)
    all_ratios = [
        r
        for f in functions.values()
        for r in (f["worst_rank_ratio_sent"], f["worst_rank_ratio_recv"], f["ratio_sent"], f["ratio_recv"])
    ]
    return {
        "cases": cases_out,
        "functions": functions,
        "halo": _halo(cases_out),
        "max_ratio": max(all_ratios) if all_ratios else None,
        "min_ratio": min([f["best_rank_ratio"] for f in functions.values()] + all_ratios) if all_ratios else None,
        "repeats_agree": _repeats_agree(cases_out, options.comm_repeats),
    }


def _case_entry(runner, function: str, detail: str, case: dict, repeat: int) -> dict:
    """One case run and judged: bytes per rank, payload and control apart, against the minimum."""
    from cp_harness.judging import comm_minimum

    report = judge_case(runner.pool, case)
    moved = comm_minimum.per_rank_moved(report)
    need = check_of(case).least_communication(case)
    assert need is not None  # the grid holds only cases of checks with a communication minimum
    entry = {
        "function": function,
        "detail": detail,
        "case": case,
        "world_size": case["world_size"],
        "sent": [m["sent"] for m in moved],
        "recv": [m["recv"] for m in moved],
        "min_sent": [s for s, _ in need],
        "min_recv": [r for _, r in need],
        "control_sent": [m["control_sent"] for m in moved],
        "control_recv": [m["control_recv"] for m in moved],
        "collective_calls": [m["calls"] for m in moved],
        "repeat": repeat,
    }
    entry["ratio"] = ratio(sum(entry["sent"]), sum(entry["min_sent"]))
    entry["worst_rank_ratio_sent"] = max(ratio(a, b) for a, b in zip(entry["sent"], entry["min_sent"]))
    entry["worst_rank_ratio_recv"] = max(ratio(a, b) for a, b in zip(entry["recv"], entry["min_recv"]))
    entry["best_rank_ratio"] = min(
        min(ratio(a, b) for a, b in zip(entry["sent"], entry["min_sent"])),
        min(ratio(a, b) for a, b in zip(entry["recv"], entry["min_recv"])),
    )
    return entry


def _per_function(cases_out: list[dict]) -> dict[str, dict]:
    """Totals and extreme per-rank ratios of each documented function over its cases."""
    functions: dict[str, dict] = {}
    for e in cases_out:
        f = functions.setdefault(
            e["function"],
            {
                "cases": 0,
                "sent": 0,
                "min_sent": 0,
                "recv": 0,
                "min_recv": 0,
                "control_sent": 0,
                "worst_rank_ratio_sent": 0.0,
                "worst_rank_ratio_recv": 0.0,
                "best_rank_ratio": float("inf"),
                "control_calls": 0,
                "control_bytes_per_peer": 0,
            },
        )
        f["cases"] += 1
        for key in ("sent", "min_sent", "recv", "min_recv", "control_sent"):
            f[key] += sum(e[key])
        f["control_calls"] += sum(1 for c in e["control_sent"] if c)
        f["control_bytes_per_peer"] = max(
            [f.get("control_bytes_per_peer", 0)] + [c // (e["world_size"] - 1) for c in e["control_sent"] if c]
        )
        f["worst_rank_ratio_sent"] = max(f["worst_rank_ratio_sent"], e["worst_rank_ratio_sent"])
        f["worst_rank_ratio_recv"] = max(f["worst_rank_ratio_recv"], e["worst_rank_ratio_recv"])
        f["best_rank_ratio"] = min(f["best_rank_ratio"], e["best_rank_ratio"])
    for f in functions.values():
        f["ratio_sent"] = ratio(f["sent"], f["min_sent"])
        f["ratio_recv"] = ratio(f["recv"], f["min_recv"])
    return functions


def _halo(cases_out: list[dict]) -> dict[str, dict]:
    """The convolution history's ratio per (N, W) and local length, from the first repeat."""
    halo: dict[str, dict] = {}
    for e in cases_out:
        if e["function"] != HALO_FUNCTION or e["repeat"]:
            continue
        n, w, L = e["case"]["world_size"], e["case"]["width"], e["case"]["shape"][1]
        h = halo.setdefault(f"N={n} W={w}", {"world_size": n, "width": w})
        h[f"L={L}"] = {
            "ratio_sent": ratio(sum(e["sent"]), sum(e["min_sent"])),
            "ratio_recv": ratio(sum(e["recv"]), sum(e["min_recv"])),
            "worst_rank_ratio": max(e["worst_rank_ratio_sent"], e["worst_rank_ratio_recv"]),
            "payload_sent": sum(e["sent"]),
            "control_sent": sum(e["control_sent"]),
            "history_spans_ranks": w - 1 > L,
        }
    return halo


def _repeats_agree(cases: list[dict], repeats: int) -> bool:
    """Whether every repeat of a case moved the same bytes as its first run (the counts must not vary)."""
    if repeats < 2:
        return True
    key = lambda e: (e["function"], e["detail"])  # noqa: E731
    first = {key(e): (e["sent"], e["recv"]) for e in cases if e["repeat"] == 0}
    return all(first[key(e)] == (e["sent"], e["recv"]) for e in cases)
