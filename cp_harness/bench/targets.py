"""The issue's targets and each section's result measured against them.

The limits are not loosened here: a miss is reported with its factor.
"""

from __future__ import annotations

TARGET_WARM_OVER_FRESH = 300.0
TARGET_COMM_RATIO = 1.0
TARGET_SUITE_SECONDS = 180.0
TARGET_SUITE_EXAMPLES = 1000


def targets_spec() -> dict:
    """The limits as the JSON report records them."""
    return {
        "warm_over_fresh_2": TARGET_WARM_OVER_FRESH,
        "comm_ratio": TARGET_COMM_RATIO,
        "suite_seconds": TARGET_SUITE_SECONDS,
        "suite_examples": TARGET_SUITE_EXAMPLES,
    }


def targets(report: dict) -> list[dict]:
    """Measured against the issue's targets; ``factor`` > 1 means better than the target by that much."""
    out = []
    tp = report.get("throughput") or {}
    if "warm_over_fresh_2" in tp:
        ratio = tp["warm_over_fresh_2"]
        out.append(
            {
                "name": "warm pool / fresh torchrun, N=2",
                "measured": ratio,
                "target": f">= {TARGET_WARM_OVER_FRESH:g}x",
                "ok": ratio >= TARGET_WARM_OVER_FRESH,
                "factor": ratio / TARGET_WARM_OVER_FRESH,
            }
        )
    comm = report.get("communication")
    if comm and comm.get("functions"):
        for name, f in comm["functions"].items():
            worst = max(f["worst_rank_ratio_sent"], f["worst_rank_ratio_recv"], f["ratio_sent"], f["ratio_recv"])
            best = min(f["best_rank_ratio"], f["ratio_sent"], f["ratio_recv"])
            ok = abs(worst - TARGET_COMM_RATIO) < 1e-12 and abs(best - TARGET_COMM_RATIO) < 1e-12
            out.append(
                {
                    "name": f"comm ratio {name}",
                    "measured": worst,
                    "target": "= 1.00 (every rank, sent and received)",
                    "ok": ok,
                    "factor": TARGET_COMM_RATIO / worst if worst else None,
                }
            )
    suite = report.get("suite")
    if suite and not suite.get("skipped"):
        out.append(
            {
                "name": "full CPU test command, wall",
                "measured": suite["seconds"],
                "target": f"< {TARGET_SUITE_SECONDS:g} s",
                "ok": suite["seconds"] < TARGET_SUITE_SECONDS and suite["returncode"] == 0,
                "factor": TARGET_SUITE_SECONDS / suite["seconds"] if suite["seconds"] else None,
            }
        )
        out.append(
            {
                "name": "CP examples in the suite",
                "measured": suite["cp_examples"],
                "target": f">= {TARGET_SUITE_EXAMPLES}",
                "ok": suite["cp_examples"] >= TARGET_SUITE_EXAMPLES,
                "factor": suite["cp_examples"] / TARGET_SUITE_EXAMPLES,
            }
        )
    memory = report.get("memory")
    if memory:
        out.append(
            {
                "name": "memory per rank falls as N grows",
                "measured": memory["falls_with_cp"],
                "target": "falls",
                "ok": bool(memory["falls_with_cp"]),
                "factor": None,
            }
        )
    return out
