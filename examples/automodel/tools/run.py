"""Gate nemo-automodel's own CP code: verify every adapter and every model spec, replay the documented defects,
judge, and print the coverage table.

``python -m examples.automodel.tools.run [--examples N] [--reports DIR] [SUBJECT ...]`` (``scripts/real_clients``
installs the pinned framework first, then runs this). Subjects are the adapters of
``examples.automodel.adapters.ADAPTERS`` (each: what ``python -m cp_harness verify --impl
examples.automodel.adapters.<adapter>`` runs, on the rows and CP sizes the adapter declares), the model specs of
``examples.automodel.models.SPECS`` (each: ``verify --model examples.automodel.models.<spec>``; a spec whose
``REQUIRES`` is unmet here is skipped, with its reason, and left to the nightly GPU job), for the specs of
``TRAINING_STEP_SPECS`` their training step (subject ``training:<spec>``: ``verify --model ... --step training
--world-sizes 4``, ``docs/training_step.md``) and the framework's CP attention functions of
``examples.automodel.attention.SUBJECTS`` (subject ``attention:<name>``: the ``cp_attention`` check on drawn cases,
``tools/attention_gate.py``; docs/real_clients.md, "The EAGLE-3 CP attention"). Every subject runs on a warm pool
it shares with the subjects of its kind and size (``tools/pools.py``); the command that runs one alone is printed
before it. With ``--lanes 2`` (the default) the model specs run in a second process beside the other subjects
(``tools/lanes.py``), each lane verifying, judging and replaying its own; this process merges their parts. Right
after each subject, the case of every row of it a documented defect reaches (``known_defects.json``,
``examples/automodel/tools/defects.py``) is replayed on its pool; then ``<reports>/summary.json`` and
``<reports>/summary.md`` get the status, the verdicts, the coverage table (``examples/automodel/tools/coverage.py``:
every CP function of the installed framework, what exercises it, where it runs) and the verify tables.
``main(argv, pool=...)`` runs the adapters and attention subjects on the caller's warm ``RankPool`` instead (the
default command's test of the gate does).

Exit status:

- ``0``: every row of every subject passed and no documented defect is expected here;
- ``3``: the only failures are documented framework defects: each failed its row with the documented signature
  and its case still fails when replayed (expected; see ``docs/real_clients.md``). The rows stay FAILED in the
  reports; nothing is skipped or tolerated;
- ``1``: a new finding: a row failed that no entry documents (or with another signature), or a documented row's
  case no longer fails when replayed (the gate lost it, or the pin changed): diagnose it;
- ``2``: the gate could not run: the framework is missing or not the pinned version, a subject does not import,
  or ``verify`` exited 2 or wrote no report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from examples.automodel.tools.defects import KNOWN, Failure, holds, load_defects, load_known  # noqa: F401 - load_defects re-exported
from examples.automodel.tools.pools import GatePools

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
REQUIREMENTS = ROOT / "constraints" / "framework.txt"  # the one home of the framework pin

OK, NEW_FINDING, CANNOT_RUN, DOCUMENTED_ONLY = 0, 1, 2, 3
STATUS_TEXT = {
    OK: "status 0: every row passed",
    DOCUMENTED_ONLY: "status 3: only documented framework defects failed (expected; docs/real_clients.md)",
    NEW_FINDING: "status 1: a new finding or a lost defect: diagnose it before changing known_defects.json",
    CANNOT_RUN: "status 2: the gate could not run",
}
SPEC_WORLD_SIZES = (1, 2, 3)  # real models on 2 cores: CP 4 and more where a spec asks for them (WORLD_SIZES)
# The model specs whose training step (``verify --step training``: dp_shard x cp = 2 x 2 on 4 ranks, the framework's
# mesh and FSDP2, docs/training_step.md) the gate runs, as subjects ``training:<spec>``. Not every CPU spec: those
# that enter CP on a deep copy of the model (``model_owned_cp.cp_twin``: qwen3_8_flash_next, glm5_next) cannot run
# under FSDP2 ("FSDP does not support deepcopy"), the forward-only ones have no backward. glm_moe_dsa runs the
# bfloat16 row only (TRAINING_DTYPES: its TileLang CP path is bfloat16 only).
TRAINING_STEP_SPECS = (
    "deepseek_v41",
    "deepseek_v4",
    "qwen3_5_moe",
    "glm_moe_dsa",
    "qwen3_5_moe_vlm",
    "qwen3_5_moe_vlm_mrope",
)
TRAINING_STEP_WORLD = 4


def pinned_version() -> str:
    """The ``nemo-automodel`` version pinned in ``constraints/framework.txt``."""
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


def ulp_text(row: dict) -> str:
    if row.get("skipped"):
        return "skipped"
    if row["comparison"] == "exact":
        return "exact" if row["ok"] else "NOT EXACT"
    return f"{row['max_ulp']:.3g}"


def markdown_table(report: dict) -> str:
    """The verify rows of one report as a Markdown table (examples, passed, max ULP, comm moved/min)."""
    lines = [
        "| function / model | examples | passed | max ULP | comm moved/min |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in report["rows"]:
        ratio = "-" if row["comm_ratio"] is None else f"{row['comm_ratio']:.2f}"
        name = row["name"] if row["ok"] else f"**{row['name']}: FAILED**"
        lines.append(f"| {name} | {row['examples']} | {row['passed']} | {ulp_text(row)} | {ratio} |")
    return "\n".join(lines)


def _sizes(declared, wanted: str) -> str:
    from cp_harness.cases.descriptions import parse_world_sizes

    sizes = [n for n in parse_world_sizes(wanted) if declared is None or n in declared]
    return ",".join(str(n) for n in sizes)


def spec_module(spec: str) -> str:
    """The dotted module of model spec ``spec``: one of ``examples.torchtitan.models.SPECS`` (torchtitan 0.3.0, the
    second real client: docs/torchtitan.md), else ``examples.automodel.models.<spec>``."""
    from examples.torchtitan.models import PACKAGE as TORCHTITAN
    from examples.torchtitan.models import SPECS as TORCHTITAN_SPECS

    return f"{TORCHTITAN}.{spec}" if spec in TORCHTITAN_SPECS else f"examples.automodel.models.{spec}"


def subject_settings(kind: str, name: str, args):
    """What ``verify`` runs for subject ``kind:name`` (``kind``: adapter, spec or training), as a ``VerifySettings``:
    an adapter on the rows (``ROWS``) and CP sizes (``WORLD_SIZES``) it declares, a model spec at the CP sizes it
    declares (default 1, 2, 3), a training step on exactly 4 ranks; ``None`` for a training subject when
    ``--world-sizes`` leaves 4 out."""
    from cp_harness.cases.descriptions import parse_world_sizes
    from cp_harness.usage.model_specs import spec_traits
    from cp_harness.verify import VerifySettings

    common = dict(examples=args.examples, backend=args.backend, seed=args.seed, shrink_seconds=args.shrink_seconds)
    if kind == "adapter":
        module = importlib.import_module(f"examples.automodel.adapters.{name}")
        sizes = _sizes(getattr(module, "WORLD_SIZES", None), args.world_sizes)
        return VerifySettings(
            impl=f"examples.automodel.adapters.{name}",
            world_sizes=parse_world_sizes(sizes),
            rows=tuple(getattr(module, "ROWS", ())),
            **common,
        )
    if kind == "spec":
        sizes = _sizes(spec_traits(spec_module(name)).world_sizes or SPEC_WORLD_SIZES, args.world_sizes)
        return VerifySettings(world_sizes=parse_world_sizes(sizes), model=(spec_module(name),), **common)
    if str(TRAINING_STEP_WORLD) not in args.world_sizes.split(","):
        return None
    return VerifySettings(world_sizes=(TRAINING_STEP_WORLD,), model=(spec_module(name),), step="training", **common)


def pool_key(kind: str, settings) -> tuple[str, int]:
    """Which of the run's pools (``tools/pools.py``) a subject's ``settings`` run on."""
    group = "training" if kind == "training" else "models" if settings.model else "impls"
    return group, max(settings.world_sizes)


def command_line(settings, json_path: Path) -> list[str]:
    """The ``python -m cp_harness verify`` command that runs ``settings`` alone (printed before each subject)."""
    what = ["--model", *settings.model] if settings.model else ["--impl", settings.impl]
    cmd = ["-m", "cp_harness", "verify", *what]
    if settings.step != "forward-backward":
        cmd += ["--step", settings.step]
    cmd += [
        "--examples",
        str(settings.examples),
        "--seed",
        str(settings.seed),
        "--world-sizes",
        ",".join(str(n) for n in settings.world_sizes),
        "--backend",
        settings.backend,
        "--shrink-seconds",
        str(settings.shrink_seconds),
        "--json",
        str(json_path),
    ]
    return cmd + (["--rows", ",".join(settings.rows)] if settings.rows else [])


def run_subject_verify(settings, json_path: Path, pool, progress_stream=None) -> int:
    """``run_verify`` of ``settings`` on the warm ``pool``, in this process: the result printed as ``verify``
    prints it and written to ``json_path``; returns ``verify``'s exit status (2 without a report)."""
    from cp_harness.verify import result_text, run_verify

    print(f"\n$ {' '.join(command_line(settings, json_path))}", flush=True)
    result = run_verify(settings, pool=pool, progress_stream=progress_stream)
    if result.cannot_run is not None:
        print(f"cp_harness verify: cannot run: {result.cannot_run}", file=sys.stderr)
        return result.exit_code
    print(result_text(result), flush=True)
    json_path.write_text(json.dumps(result.as_dict(), indent=2, allow_nan=False) + "\n")
    return result.exit_code


def replay(defect: dict, backend: str, pool=None) -> tuple[bool, str]:
    """Run a documented row's case again (``defect``: an entry of ``load_known``); ``(fails with its signature,
    account)``. ``pool``: a warm ``RankPool`` of at least the case's world size to run it on (else one is started)."""
    from cp_harness.cases.meshes import ranks_needed
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    case = dict(defect["case"])
    if "adapter" in defect:
        case["impl"] = f"examples.automodel.adapters.{defect['adapter']}"
    if pool is not None:
        runner = CaseRunner(pool.config, pool=pool)
    else:
        runner = CaseRunner(
            PoolConfig(
                world_size=ranks_needed(case),
                backend=backend,
                impl=case.get("impl", "cp_impl"),
                preload=(case["spec"],) if "spec" in case else (),
                case_timeout=300.0 if "spec" in case else 60.0,
            )
        )
    try:
        report = runner.run(case)
    finally:
        if pool is None:
            runner.close()
    names = [c.name for c in report.failures()]
    if report.ok:
        return False, "the case passes now"
    if not defect["signature"].matches(Failure.of_report(report)):
        return False, "it fails differently: " + "; ".join([p.message for p in report.problems] + names)
    return True, f"fails as documented ({len(names)} tensors wrong: {', '.join(names) or 'none'}" + (
        f"; {len(report.problems)} problem(s)" if report.problems else ""
    ) + ")"


def documented_entry(subject: str, row: str, case: dict | None, known: list[dict], backend: str) -> dict | None:
    """The entry of ``known`` (``load_known``) that documents a failure of ``subject``'s row labelled ``row`` on
    ``case`` under ``backend`` (its ``when`` holds for the case), or ``None``; whether the failure shows the
    entry's signature is the caller's question."""
    return next(
        (
            d
            for d in known
            if d["subject"] == subject and d["row"] == row and backend in d["backends"] and holds(d.get("when"), case)
        ),
        None,
    )


def known_failure(subject: str, known: list[dict], backend: str):
    """``VerifySettings.known_failure`` for ``subject``: a failing case that a documented defect of the subject's
    row explains (the entry's ``when`` holds for it and the failure shows its signature, as ``judge`` decides) is
    not shrunk. Its row is judged documented whatever the shrink would have ended on, and the defect's own case
    is replayed after its subject (``_replay_all``): the shrinking runs would only spend the row's budget on a
    failure the gate already accounts for. Any other failure shrinks as before."""

    def explained(row: str, case: dict, report) -> str | None:
        match = documented_entry(subject, row, case, known, backend)
        if match is None or not match["signature"].matches(Failure.of_report(report)):
            return None
        return f"documented {match['classification']} {match['id']} explains it (its documented case is replayed)"

    return explained


def judge(subject: str, report: dict, known: list[dict], backend: str) -> list[dict]:
    """One verdict per failing row of ``subject`` (``adapter:X`` / ``spec:X``):
    ``{"subject", "row", "defect" (id or None), "why"}``."""
    verdicts = []
    for row in report["rows"]:
        if row["ok"]:
            continue
        failure = Failure.of_row(row)
        match = documented_entry(subject, row["name"], row.get("failing_case"), known, backend)
        if match is not None and match["signature"].matches(failure):
            verdicts.append(
                {
                    "subject": subject,
                    "row": row["name"],
                    "defect": match["id"],
                    "why": f"documented {match['classification']} {match['id']}: {match['title']}",
                }
            )
        else:
            why = (
                "no documented defect covers this row"
                if match is None
                else f"row of {match['id']} failed with another signature than {match['signature'].text!r}"
            )
            verdicts.append({"subject": subject, "row": row["name"], "defect": None, "why": why})
    return verdicts


def _replay_all(rows: list[dict], backend: str, warm) -> list[dict]:
    """Replay every documented row's case (rows of one subject) on ``warm``, the pool its subject ran on; a case
    that needs more ranks than it has gets a pool of its own."""
    from cp_harness.cases.meshes import ranks_needed

    out = []
    for row in rows:
        pool = warm if ranks_needed(row["case"]) <= warm.config.world_size else None
        reproduced, account = replay(row, backend, pool=pool)
        out.append(
            {
                "defect": row["id"],
                "subject": row["subject"],
                "row": row["row"],
                "reproduced": reproduced,
                "account": account,
            }
        )
    return out


def _subjects(names: list[str]) -> list[str]:
    from examples.automodel.adapters import ADAPTERS
    from examples.automodel.attention import SUBJECTS as ATTENTION
    from examples.automodel.models import SPECS as AUTOMODEL_SPECS
    from examples.torchtitan.models import SPECS as TORCHTITAN_SPECS

    SPECS = AUTOMODEL_SPECS + TORCHTITAN_SPECS  # torchtitan 0.3.0's specs: docs/torchtitan.md
    every = [f"adapter:{a}" for a in ADAPTERS] + [f"spec:{s}" for s in SPECS]
    every += [f"training:{s}" for s in TRAINING_STEP_SPECS]
    every += [f"attention:{s}" for s in ATTENTION]
    if not names:
        return every
    chosen = []
    for name in names:
        found = [s for s in every if s == name or s.split(":", 1)[1] == name]
        if not found:
            raise SystemExit(
                f"unknown subject {name!r}; known adapters: {', '.join(ADAPTERS)}; model specs: {', '.join(SPECS)}; "
                f"attention subjects: {', '.join(ATTENTION)}"
            )
        chosen += found
    return chosen


def _gate(subjects: list[str], args, known: list[dict], reports: Path, pool=None) -> dict:
    """Verify, judge and replay ``subjects`` in this process (``tools/pools.py``); their part of the summary:
    ``{"subjects", "skipped", "findings", "replays", "crashed"}``."""
    from cp_harness.cases.descriptions import parse_world_sizes
    from examples.automodel.tools import coverage

    summary: dict = {"subjects": {}, "skipped": {}, "findings": [], "replays": []}
    crashed = []
    sizes = tuple(parse_world_sizes(args.world_sizes))  # an attention subject draws its cases over all of them
    pools = GatePools(args.backend, given=pool)
    planned: list[tuple[str, Path, object]] = []  # (subject, report path, its settings or None for attention)
    keys: dict[str, tuple[str, int]] = {}
    for subject in subjects:
        kind, name = subject.split(":", 1)
        path = reports / (f"{name}.training_step.json" if kind == "training" else f"{name}.json")
        if path.exists():
            path.unlink()
        if kind in ("spec", "training", "attention"):
            if kind == "attention":
                from examples.automodel.tools.attention_gate import unmet as attention_unmet

                unmet = attention_unmet(name, args.backend)
            else:
                unmet = coverage.spec_unmet(spec_module(name))
            if unmet:
                summary["skipped"][subject] = unmet
                where = "install flash-attn 2.8 beside it" if kind == "attention" else "the nightly GPU job runs it"
                print(f"\nreal clients: skipped {subject}: {unmet} ({where})", flush=True)
                continue
        try:
            settings = None if kind == "attention" else subject_settings(kind, name, args)
        except Exception as exc:  # noqa: BLE001 - a subject that does not import cannot be gated
            crashed.append(f"{subject}: {type(exc).__name__}: {exc}")
            continue
        if kind == "training" and settings is None:
            print(f"\nreal clients: {subject} needs --world-sizes with {TRAINING_STEP_WORLD}; not run", flush=True)
            continue
        if settings is not None:
            settings = dataclasses.replace(settings, known_failure=known_failure(subject, known, args.backend))
        if settings is None:
            keys[subject] = ("impls", max(sizes))
        else:
            keys[subject] = pool_key(kind, settings)
            pools.plan(keys[subject], settings.model or [settings.impl])
        planned.append((subject, path, settings))

    # Progress as verify prints it, unless the caller's pool says this runs inside another command (the test).
    progress = open(os.devnull, "w") if pool is not None else None  # noqa: SIM115 - closed below
    try:
        for subject, path, settings in planned:
            kind, name = subject.split(":", 1)
            try:
                warm = pools.pool(keys[subject])
                if settings is None:
                    from examples.automodel.tools.attention_gate import run_subject

                    code = run_subject(name, args.examples, args.seed, sizes, args.backend, path, pool=warm)
                else:
                    code = run_subject_verify(settings, path, warm, progress_stream=progress)
            except Exception as exc:  # noqa: BLE001 - a subject that does not import (or whose pool does not start)
                crashed.append(f"{subject}: {type(exc).__name__}: {exc}")
                continue
            if code == 2 or not path.exists():
                crashed.append(f"{subject}: verify exited {code}" + ("" if path.exists() else " without a report"))
                continue
            report = json.loads(path.read_text())
            summary["subjects"][subject] = {
                "verify_exit": code,
                "report": str(path),
                "table": markdown_table(report),
                "failed_rows": report["failed_rows"],
                "not_judged": {r["name"]: r.get("not_judged") for r in report["rows"] if r.get("not_judged")},
            }
            summary["findings"] += judge(subject, report, known, args.backend)
            # The subject's documented rows are replayed now, on its pool while the ranks still hold what its cases
            # compiled: a rank that runs another spec's case forgets it (``model_specs.one_spec_at_a_time``).
            to_replay = [d for d in known if d["subject"] == subject and args.backend in d["backends"]]
            summary["replays"] += _replay_all(to_replay, args.backend, warm)
    finally:
        pools.close()
        if progress is not None:
            progress.close()

    summary["crashed"] = crashed
    return summary


def main(argv: list[str] | None = None, *, pool=None) -> int:
    """The gate's command line; returns its exit status. ``pool``: run the adapters, the attention subjects and
    their replays on this warm ``RankPool`` (it needs ``max(--world-sizes)`` ranks) instead of the run's own pools
    (the model specs and training steps always get pools of their own, ``tools/pools.py``)."""
    parser = argparse.ArgumentParser(prog="python -m examples.automodel.tools.run", description=__doc__.split("\n")[0])
    parser.add_argument("subjects", nargs="*", help="adapters or model specs by name (default: all)")
    parser.add_argument("--examples", type=int, default=25, help="examples per verify row (default 25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-sizes", default="1,2,3,4,8")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument(
        "--shrink-seconds",
        type=float,
        default=20.0,
        help="how long a failing row may shrink its failure (default %(default)s s, as verify's; it was 60 s before "
        "a pool restart forked from an imported launcher: docs/benchmarks.md)",
    )
    parser.add_argument("--reports", default="reports/real_clients", help="folder for the JSON reports and summary")
    parser.add_argument("--known", default=str(KNOWN), help="the documented defects (default: %(default)s)")
    parser.add_argument(
        "--lanes",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): the model specs in a process of their own beside the other subjects (tools/lanes.py)",
    )
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a lane's summary file (tools/lanes.py)
    parser.add_argument(
        "--no-coverage",
        dest="coverage",
        action="store_false",
        help="leave out the coverage table (it imports every model spec: tens of seconds)",
    )
    args = parser.parse_args(argv)
    subjects = _subjects(args.subjects)
    problem = framework_problem()
    if problem:
        print(f"real clients: cannot run: {problem}", file=sys.stderr)
        return CANNOT_RUN
    try:
        known = load_known(Path(args.known))
    except (OSError, ValueError, KeyError) as exc:
        print(f"real clients: cannot run: {args.known}: {exc}", file=sys.stderr)
        return CANNOT_RUN

    from examples.automodel.tools import coverage, lanes

    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    parts = lanes.split(subjects, args.lanes if pool is None and args.part is None else 1)
    if len(parts) > 1:
        common = [
            "--examples",
            str(args.examples),
            "--seed",
            str(args.seed),
            "--world-sizes",
            args.world_sizes,
            "--backend",
            args.backend,
            "--shrink-seconds",
            str(args.shrink_seconds),
            "--known",
            args.known,
            "--reports",
            str(reports),
        ]
        done = lanes.run(common, parts, reports)
    else:
        done = [_gate(subjects, args, known, reports, pool)]
    if args.part is not None:  # a lane of another run: that run judges and reports
        Path(args.part).write_text(json.dumps(done[0]) + "\n")
        return OK
    order = {subject: i for i, subject in enumerate(subjects)}
    summary: dict = {
        "framework": f"nemo-automodel=={pinned_version()}",
        "backend": args.backend,
        "examples_per_row": args.examples,
        "subjects": dict(
            sorted((item for part in done for item in part["subjects"].items()), key=lambda kv: order[kv[0]])
        ),
        "skipped": {k: v for part in done for k, v in part["skipped"].items()},
        "findings": sorted((f for part in done for f in part["findings"]), key=lambda f: order[f["subject"]]),
        "replays": sorted((r for part in done for r in part["replays"]), key=lambda r: order[r["subject"]]),
    }
    crashed = [line for part in done for line in part["crashed"]]

    new = [f for f in summary["findings"] if f["defect"] is None]
    lost = [r for r in summary["replays"] if not r["reproduced"]]
    # A documented defect counts when its row failed with its signature or its replayed case failed (a search
    # with few examples may miss the row; the replay is deterministic).
    documented = [f for f in summary["findings"] if f["defect"] is not None] + [
        r for r in summary["replays"] if r["reproduced"]
    ]
    status = CANNOT_RUN if crashed else NEW_FINDING if (new or lost) else DOCUMENTED_ONLY if documented else OK
    summary["status"] = status

    lines = []
    for subject, entry in summary["subjects"].items():
        lines.append(
            f"  {subject}: {'all rows passed' if not entry['failed_rows'] else 'FAILED ' + ', '.join(entry['failed_rows'])}"
        )
        for row, what in entry["not_judged"].items():
            lines += [f"    not judged in {row}: {w} ({why})" for w, why in what.items()]
    lines += [f"  skipped {subject}: {why}" for subject, why in summary["skipped"].items()]
    lines += [f"  COULD NOT RUN {line}" for line in crashed]
    for f in summary["findings"]:
        lines.append(f"  {'documented' if f['defect'] else 'NEW FINDING'}: {f['subject']} / {f['row']}: {f['why']}")
    for r in summary["replays"]:
        lines.append(
            f"  replay of {r['defect']} ({r['subject']} / {r['row']}): {r['account']}"
            + ("" if r["reproduced"] else "  <- LOST")
        )
        if r["reproduced"] and not any(
            f["defect"] == r["defect"] and f["subject"] == r["subject"] and f["row"] == r["row"]
            for f in summary["findings"]
        ):
            lines.append("    (verify's search did not reach this row's failure this run; its replay did)")
    summary["verdicts"] = lines
    table = coverage.build(summary, known) if args.coverage else None
    summary["coverage"] = table.as_dict() if table is not None else None
    (reports / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [
        f"# Real clients: {summary['framework']}, backend {args.backend}, {args.examples} examples per row",
        "",
        f"**{STATUS_TEXT[status]}**",
        "",
        "```",
        *[line[2:] for line in lines],
        "```",
        "",
    ]
    if table is not None:
        md += ["## Coverage of the framework's CP code", "", table.markdown(), ""]
    for subject, entry in summary["subjects"].items():
        md += [f"## {subject}", "", entry["table"], ""]
    (reports / "summary.md").write_text("\n".join(md))

    if table is not None:
        print("\nreal clients: coverage of the framework's CP code")
        print(table.text())
    print("\nreal clients: summary")
    print("\n".join(lines))
    print(STATUS_TEXT[status])
    print(f"reports: {reports}/ (summary.md, summary.json, one JSON per subject)")
    return status


if __name__ == "__main__":
    sys.exit(main())
