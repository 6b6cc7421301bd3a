"""The ``attention:<subject>`` subjects of ``scripts/real_clients``: the framework's CP attention functions
(``examples/automodel/attention/``) under the ``cp_attention`` check, cases drawn by Hypothesis.

``run_subject(name, examples, seed, world_sizes, backend, json_path, pool=None) -> exit status`` draws ``examples``
cases per dtype of the subject (derandomized from ``seed``; CP sizes of the subject's ``WORLD_SIZES`` within
``world_sizes``), runs each on a pool (``pool``, else one of the largest CP size drawn), judges it against float64
attention and, at ``N > 1``, against the same subject on one rank, and writes a report in ``verify --json``'s shape
(one row per dtype, ``attention: <subject> (<dtype>)``; the first failing case of a row with its failing tensors and
problems), which ``run.judge`` and ``run.markdown_table`` read as they read verify's. 0: every case passed; 1: a
case failed; 2: the subject does not import.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

PACKAGE = "examples.automodel.attention"


def unmet(subject: str, backend: str) -> str | None:
    """Why ``subject`` cannot run here (``None``: it can). On ``nccl`` (GPU ranks) the stand-in is not entered and
    the real flash-attn 2.8 kernels run, so flash-attn must be installed; never run so far."""
    import importlib.util

    if backend == "nccl" and importlib.util.find_spec("flash_attn") is None:
        return "needs flash_attn: on GPU ranks the real flash-attn 2.8 kernels run (flash_attn_cpu is CPU only)"
    return None


def drawn_cases(
    subject: str, examples: int, seed: int, world_sizes: tuple[int, ...], dtype: str, package: str = PACKAGE
) -> list[dict]:
    """``examples`` cases of ``subject`` in ``dtype``, the same for the same arguments."""
    from cp_harness.checks import cp_attention

    out: list[dict] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        derandomize=False,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(cp_attention.cases(f"{package}.{subject}" if package else subject, world_sizes, dtype))
    def collect(case):
        out.append(case)

    collect()
    return out[:examples]


def run_subject(
    subject: str, examples: int, seed: int, world_sizes: tuple[int, ...], backend: str, json_path: Path, pool=None
) -> int:
    from cp_harness.checks import cp_attention
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    module = cp_attention.load_subject(f"{PACKAGE}.{subject}")
    plan = {d: drawn_cases(subject, examples, seed, world_sizes, d) for d in module.DTYPES}
    size = max(int(c["world_size"]) for cases in plan.values() for c in cases)
    runner = (
        CaseRunner(pool.config, pool=pool)
        if pool is not None
        else CaseRunner(PoolConfig(world_size=size, backend=backend, impl="cp_impl", case_timeout=120.0))
    )
    rows = []
    try:
        for dtype, cases in plan.items():
            row: dict = {
                "name": f"attention: {subject} ({dtype})",
                "id": f"cp_attention.{subject}.{dtype}",
                "examples": 0,
                "passed": 0,
                "comparison": "ulp",
                "max_ulp": 0.0,
                "max_excess": 0.0,  # CP error / (one-rank error + floor / c), the worst tensor of the row
                "comm_ratio": None,
                "standins": {},
                "failing_case": None,
                "failing_tensors": [],
                "problems": [],
            }
            for case in cases:
                report = runner.run(case)
                row["examples"] += 1
                row["passed"] += int(report.ok)
                row["max_ulp"] = max(row["max_ulp"], float(report.max_ulp or 0.0))
                row["standins"].update(report.standins)
                excess = [v.excess for c in report.comparisons if (v := getattr(c, "excess", None)) is not None]
                row["max_excess"] = max([row["max_excess"], *excess])
                if not report.ok and row["failing_case"] is None:
                    row["failing_case"] = case
                    row["failing_tensors"] = [c.as_dict() for c in report.failures()]
                    row["problems"] = [{"message": p.message, "detail": p.detail} for p in report.problems]
            row["ok"] = row["passed"] == row["examples"]
            rows.append(row)
            print(
                f"{row['name']}: {row['passed']}/{row['examples']} passed, max {row['max_ulp']:.3g} ULP, "
                f"CP excess {row['max_excess']:.3g}"
                + ("" if row["ok"] else f"; FAILED, first: {json.dumps(row['failing_case'])}"),
                flush=True,
            )
    finally:
        if pool is None:
            runner.close()
    report_json = {
        "subject": f"attention:{subject}",
        "framework_function": module.FRAMEWORK_FUNCTION,
        "rows": rows,
        "failed_rows": [r["name"] for r in rows if not r["ok"]],
    }
    json_path.write_text(json.dumps(report_json, indent=2, default=str) + "\n")
    return 0 if not report_json["failed_rows"] else 1


if __name__ == "__main__":  # python -m examples.automodel.tools.attention_gate <subject> [examples]
    sys.exit(run_subject(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10, 0, (1, 2, 3, 4), "gloo",
                         Path(f"/tmp/{sys.argv[1]}.json")))  # fmt: skip
