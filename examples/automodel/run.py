"""Gate nemo-automodel's own CP primitives: verify every adapter, replay the documented defects, judge.

``python -m examples.automodel.run [--examples N] [--reports DIR] [ADAPTER ...]`` (``scripts/real_clients``
installs the pinned framework first, then runs this). For each adapter of ``examples.automodel.ADAPTERS``
it runs ``python -m cp_harness verify --impl examples.automodel.<adapter> --json <reports>/<adapter>.json``
(a fresh rank pool each), then replays the case of every row a documented defect reaches
(``known_defects.json``: each defect lists the ``(adapter, row)`` pairs it reaches, why, and a case of each) on
one pool, and writes ``<reports>/summary.json`` and ``<reports>/summary.md`` (the tables of
``docs/real_clients.md``, the verdicts and the status). ``main(argv, pool=...)`` runs the same gate in this
process on a warm ``RankPool`` (the default command's test of the gate does).

Exit status:

- ``0``: every row of every adapter passed and no documented defect is expected here;
- ``3``: the only failures are documented framework defects: each failed its row with the documented
  signature and its case still fails when replayed (expected; see ``docs/real_clients.md``). The rows
  stay FAILED in the reports; nothing is skipped or tolerated;
- ``1``: a new finding: a row failed that no entry documents (or with another signature), or a
  documented row's case no longer fails when replayed (the gate lost it, or the pin changed): diagnose it;
- ``2``: the gate could not run: the framework is missing or not the pinned version, an adapter does
  not import, or ``verify`` exited 2 or wrote no report.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KNOWN = HERE / "known_defects.json"
REQUIREMENTS = HERE / "requirements.txt"

OK, NEW_FINDING, CANNOT_RUN, DOCUMENTED_ONLY = 0, 1, 2, 3


def pinned_version() -> str:
    """The ``nemo-automodel`` version pinned in ``requirements.txt``."""
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("nemo-automodel=="):
            return line.split("==", 1)[1]
    raise ValueError(f"{REQUIREMENTS} pins no nemo-automodel version")


def framework_problem() -> str | None:
    """Why the framework cannot be gated here (``None`` when the pinned version imports)."""
    want = pinned_version()
    try:
        have = importlib.metadata.version("nemo-automodel")
    except importlib.metadata.PackageNotFoundError:
        return f"nemo-automodel is not installed (pip install --no-deps -r {REQUIREMENTS.relative_to(ROOT)})"
    if have != want:
        return f"nemo-automodel {have} is installed, the adapters are pinned to {want}"
    try:
        importlib.import_module("nemo_automodel")
    except Exception as exc:  # noqa: BLE001 - any import failure means the gate cannot run
        return f"nemo_automodel does not import: {type(exc).__name__}: {exc}"
    return None


DEFECT_FIELDS = ("id", "title", "doc", "repro", "backends", "signature", "rows")
ROW_FIELDS = ("adapter", "row", "why", "case")


def load_defects(path: Path = KNOWN) -> list[dict]:
    """The documented defects of ``path``, checked: every field present, every reached row named once.

    A defect is ``{"id", "title", "doc", "repro", "backends", "signature", "rows": [{"adapter", "row", "why",
    "case"}, ...]}``: the ``(adapter, verify row)`` pairs it reaches, why it reaches each, and a case of that
    row that fails while the defect is there. ``ValueError`` names the entry and the field."""
    defects = json.loads(Path(path).read_text())["defects"]
    seen: dict[tuple, str] = {}
    for i, defect in enumerate(defects):
        missing = [f for f in DEFECT_FIELDS if f not in defect]
        if missing:
            raise ValueError(f"{path}: defect #{i} ({defect.get('id', '?')}) has no {', '.join(missing)}")
        if not defect["rows"]:
            raise ValueError(f"{path}: defect {defect['id']} lists no row it reaches (rows: [] )")
        for j, row in enumerate(defect["rows"]):
            missing = [f for f in ROW_FIELDS if f not in row]
            if missing:
                raise ValueError(f"{path}: defect {defect['id']} rows[{j}] has no {', '.join(missing)}")
            for backend in defect["backends"]:
                key = (row["adapter"], row["row"], backend)
                if key in seen:
                    raise ValueError(f"{path}: {row['adapter']} / {row['row']} ({backend}) is listed by both "
                                     f"{seen[key]} and {defect['id']}: a row has one documented cause")
                seen[key] = defect["id"]
    return defects


def load_known(path: Path = KNOWN) -> list[dict]:
    """One entry per documented row: the defect's fields (``id``, ``title``, ``backends``, ...) and the row's
    (``adapter``, ``row``, ``why``, ``case``)."""
    return [{**{k: v for k, v in defect.items() if k != "rows"}, **row}
            for defect in load_defects(path) for row in defect["rows"]]


def gradient_only(failing_tensors: list[dict], problems: list) -> bool:
    """The documented signature: no problem (no rank raised), and every failing tensor is a gradient (the forward
    is right). ``failing_tensors``: the comparisons as data (``Comparison.as_dict``; ``gradient`` is their role)."""
    return bool(failing_tensors) and not problems and all(t["gradient"] for t in failing_tensors)


def ulp_text(row: dict) -> str:
    if row["comparison"] == "exact":
        return "exact" if row["ok"] else "NOT EXACT"
    return f"{row['max_ulp']:.3g}"


def markdown_table(report: dict) -> str:
    """The verify rows of one report as a Markdown table (examples, passed, max ULP, comm moved/min)."""
    lines = ["| function / model | examples | passed | max ULP | comm moved/min |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in report["rows"]:
        ratio = "-" if row["comm_ratio"] is None else f"{row['comm_ratio']:.2f}"
        name = row["name"] if row["ok"] else f"**{row['name']}: FAILED**"
        lines.append(f"| {name} | {row['examples']} | {row['passed']} | {ulp_text(row)} | {ratio} |")
    return "\n".join(lines)


def run_verify(adapter: str, args, json_path: Path, pool=None) -> int:
    """``cp_harness verify`` on one adapter: in its own process (its output goes to ours), or, given a warm
    ``pool``, in this process on that pool (its ranks load the adapter on first use)."""
    cmd = [sys.executable, "-m", "cp_harness", "verify", "--impl", f"examples.automodel.{adapter}",
           "--examples", str(args.examples), "--seed", str(args.seed), "--world-sizes", args.world_sizes,
           "--backend", args.backend, "--shrink-seconds", str(args.shrink_seconds), "--json", str(json_path)]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    if pool is None:
        return subprocess.run(cmd, cwd=ROOT).returncode
    from cp_harness.cases.descriptions import parse_world_sizes
    from cp_harness.verify import VerifySettings, result_text, run_verify

    settings = VerifySettings(impl=f"examples.automodel.{adapter}", world_sizes=parse_world_sizes(args.world_sizes),
                              examples=args.examples, backend=args.backend, seed=args.seed,
                              shrink_seconds=args.shrink_seconds)
    with open(os.devnull, "w") as quiet:
        result = run_verify(settings, pool=pool, progress_stream=quiet)
    if result.cannot_run is not None:
        print(f"cp_harness verify: cannot run: {result.cannot_run}", file=sys.stderr)
        return result.exit_code
    print(result_text(result))
    json_path.write_text(json.dumps(result.as_dict(), indent=2, allow_nan=False) + "\n")
    return result.exit_code


def replay(defect: dict, backend: str, pool=None) -> tuple[bool, str]:
    """Run a documented row's case again (``defect``: an entry of ``load_known``); ``(fails with its signature,
    account)``.

    ``pool``: a warm ``RankPool`` of at least the case's world size to run it on (else one is started)."""
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    impl = f"examples.automodel.{defect['adapter']}"
    case = {**defect["case"], "impl": impl}
    if pool is not None:
        runner = CaseRunner(pool.config, pool=pool)
    else:
        runner = CaseRunner(PoolConfig(world_size=int(case["world_size"]), backend=backend, impl=impl))
    try:
        report = runner.run(case)
    finally:
        if pool is None:
            runner.close()
    names = [c.name for c in report.failures()]
    if report.ok:
        return False, "the case passes now"
    if not gradient_only([c.as_dict() for c in report.failures()], report.problems):
        return False, "it fails differently: " + "; ".join([p.message for p in report.problems] + names)
    return True, f"fails as documented ({len(names)} gradients wrong: {', '.join(names)})"


def judge(adapter: str, report: dict, known: list[dict], backend: str) -> list[dict]:
    """One verdict per failing row: ``{"adapter", "row", "defect" (id or None), "why"}``."""
    verdicts = []
    for row in report["rows"]:
        if row["ok"]:
            continue
        names = [t["name"] for t in row["failing_tensors"]]
        problems = row["problems"] or not names
        match = next((d for d in known if d["adapter"] == adapter and d["row"] == row["name"]
                      and backend in d["backends"]), None)
        if match is not None and gradient_only(row["failing_tensors"], problems):
            verdicts.append({"adapter": adapter, "row": row["name"], "defect": match["id"],
                             "why": f"documented framework defect {match['id']}: {match['title']}"})
        else:
            why = "no documented defect covers this row" if match is None else \
                f"row of {match['id']} failed with another signature ({'a rank raised' if problems else ', '.join(names)})"
            verdicts.append({"adapter": adapter, "row": row["name"], "defect": None, "why": why})
    return verdicts


STATUS_TEXT = {OK: "status 0: every row passed",
               DOCUMENTED_ONLY: "status 3: only documented framework defects failed (expected; docs/real_clients.md)",
               NEW_FINDING: "status 1: a new finding or a lost defect: diagnose it before changing known_defects.json",
               CANNOT_RUN: "status 2: the gate could not run"}


def _replay_all(rows: list[dict], backend: str, pool=None) -> list[dict]:
    """Replay every documented row's case on one pool (``pool``, else one of the largest world size needed)."""
    from cp_harness.ranks.pool import PoolConfig, RankPool

    if not rows:
        return []
    own = None
    if pool is None:
        size = max(int(r["case"]["world_size"]) for r in rows)
        own = pool = RankPool(PoolConfig(world_size=size, backend=backend,
                                         impl=f"examples.automodel.{rows[0]['adapter']}"))
    out = []
    try:
        for row in rows:
            if int(row["case"]["world_size"]) > pool.config.world_size:
                out.append({"defect": row["id"], "adapter": row["adapter"], "row": row["row"], "reproduced": False,
                            "account": f"not replayed: its case needs {row['case']['world_size']} ranks, the pool "
                                       f"has {pool.config.world_size}"})
                continue
            reproduced, account = replay(row, backend, pool=pool)
            out.append({"defect": row["id"], "adapter": row["adapter"], "row": row["row"], "reproduced": reproduced,
                        "account": account})
    finally:
        if own is not None:
            own.close()
    return out


def main(argv: list[str] | None = None, *, pool=None) -> int:
    """The gate's command line; returns its exit status. ``pool``: run every verify and replay in this process
    on this warm ``RankPool`` (it needs ``max(--world-sizes)`` ranks) instead of a fresh pool per adapter."""
    from examples.automodel import ADAPTERS

    parser = argparse.ArgumentParser(prog="python -m examples.automodel.run", description=__doc__.split("\n")[0])
    parser.add_argument("adapters", nargs="*", default=list(ADAPTERS), help=f"default: {' '.join(ADAPTERS)}")
    parser.add_argument("--examples", type=int, default=25, help="examples per verify row (default 25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-sizes", default="1,2,3,4,8")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--shrink-seconds", type=float, default=60.0)
    parser.add_argument("--reports", default="reports/real_clients", help="folder for the JSON reports and summary")
    parser.add_argument("--known", default=str(KNOWN), help="the documented defects (default: %(default)s)")
    args = parser.parse_args(argv)
    unknown = [a for a in args.adapters if a not in ADAPTERS]
    if unknown:
        parser.error(f"unknown adapter(s) {unknown}; known: {', '.join(ADAPTERS)}")
    problem = framework_problem()
    if problem:
        print(f"real clients: cannot run: {problem}", file=sys.stderr)
        return CANNOT_RUN
    try:
        known = load_known(Path(args.known))
    except (OSError, ValueError, KeyError) as exc:
        print(f"real clients: cannot run: {args.known}: {exc}", file=sys.stderr)
        return CANNOT_RUN

    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    summary: dict = {"framework": f"nemo-automodel=={pinned_version()}", "backend": args.backend,
                     "examples_per_row": args.examples, "adapters": {}, "findings": [], "replays": []}
    crashed = []
    for adapter in args.adapters:
        path = reports / f"{adapter}.json"
        if path.exists():
            path.unlink()
        code = run_verify(adapter, args, path, pool=pool)
        if code == 2 or not path.exists():
            crashed.append(f"{adapter}: verify exited {code}" + ("" if path.exists() else " without a report"))
            continue
        report = json.loads(path.read_text())
        module = importlib.import_module(f"examples.automodel.{adapter}")
        summary["adapters"][adapter] = {"verify_exit": code, "serves": module.SERVES, "report": str(path),
                                        "table": markdown_table(report), "failed_rows": report["failed_rows"]}
        summary["findings"] += judge(adapter, report, known, args.backend)

    to_replay = [d for d in known if d["adapter"] in summary["adapters"] and args.backend in d["backends"]]
    summary["replays"] = _replay_all(to_replay, args.backend, pool)

    new = [f for f in summary["findings"] if f["defect"] is None]
    lost = [r for r in summary["replays"] if not r["reproduced"]]
    # A documented defect counts when its row failed with its signature or its replayed case failed (a search
    # with few examples may miss the row; the replay is deterministic).
    documented = [f for f in summary["findings"] if f["defect"] is not None] + \
        [r for r in summary["replays"] if r["reproduced"]]
    status = CANNOT_RUN if crashed else NEW_FINDING if (new or lost) else DOCUMENTED_ONLY if documented else OK
    summary["status"] = status

    lines = []
    for adapter, entry in summary["adapters"].items():
        lines.append(f"  {adapter}: {'all rows passed' if not entry['failed_rows'] else 'FAILED ' + ', '.join(entry['failed_rows'])}")
    lines += [f"  COULD NOT RUN {line}" for line in crashed]
    for f in summary["findings"]:
        lines.append(f"  {'documented' if f['defect'] else 'NEW FINDING'}: {f['adapter']} / {f['row']}: {f['why']}")
    for r in summary["replays"]:
        lines.append(f"  replay of {r['defect']} ({r['adapter']} / {r['row']}): {r['account']}"
                     + ("" if r["reproduced"] else "  <- LOST"))
        if r["reproduced"] and not any(f["defect"] == r["defect"] and f["adapter"] == r["adapter"]
                                       and f["row"] == r["row"] for f in summary["findings"]):
            lines.append(f"    (verify's search did not reach this row's failure this run; its replay did)")
    summary["verdicts"] = lines
    (reports / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"# Real clients: {summary['framework']}, backend {args.backend}, {args.examples} examples per row", "",
          f"**{STATUS_TEXT[status]}**", "", "```", *[line[2:] for line in lines], "```", ""]
    for adapter, entry in summary["adapters"].items():
        served = ", ".join(f"`{k}` <- `{v}`" for k, v in entry["serves"].items())
        md += [f"## {adapter}", "", served, "", entry["table"], ""]
    (reports / "summary.md").write_text("\n".join(md))

    print("\nreal clients: summary")
    print("\n".join(lines))
    print(STATUS_TEXT[status])
    print(f"reports: {reports}/ (summary.md, summary.json, one JSON per adapter)")
    return status


if __name__ == "__main__":
    sys.exit(main())
