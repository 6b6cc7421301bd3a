"""The coverage table: every CP function of the installed framework, what exercises it, where it runs.

Generated, never written by hand, from what the code declares:

- the framework's CP code: every public top-level function and class of
  ``components/distributed/context_parallel/``, ``components/distributed/blockdiag_cp/`` and
  ``components/models/*/cp*.py`` (read from the installed sources with ``ast``: nothing is imported), plus every
  other callable an adapter or spec names;
- what exercises it: each adapter's ``SERVES`` (documented function -> framework callable) and ``ALSO_USES``
  (other framework callables its hooks run), and each model spec's ``COVERS`` (framework callable -> what its CP
  path does with it);
- where it runs: the **default command** (the test files under ``tests/`` whose ``JUDGES`` name the adapter or
  spec: the subjects whose CP path they run and judge),
  **real_clients** (this run: passed, failed as documented, a new finding, or skipped with the spec's unmet
  ``REQUIRES``) and the **nightly GPU** job (``.github/workflows/nightly.yml``: ``real_clients --backend nccl`` runs
  every adapter, ``verify --model`` lines name the specs), and **on CPU**, how the subjects' CP paths run in the
  two CPU places: on the framework's and torch's own kernels, on a kernel stand-in (``cp_harness.standins``,
  the spec's ``STANDINS``: "CPU, stand-in: ..."), forward only (the spec's ``FORWARD_ONLY_ON``), or not at all
  (unmet ``REQUIRES``); the nightly GPU runs the real kernels;
- why a function is not judged: ``examples.automodel.adapters.NOT_ADAPTED`` (looked at, and why no adapter fits), else "no
  adapter or spec exercises it".
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CP_SOURCES = (
    "components/distributed/context_parallel/*.py",
    "components/distributed/blockdiag_cp/*.py",
    "components/models/*/cp*.py",
)


def framework_functions() -> list[str]:
    """Dotted paths of the public top-level functions and classes of the framework's CP modules (sources only)."""
    spec = importlib.util.find_spec("nemo_automodel")
    if spec is None or not spec.submodule_search_locations:
        return []
    package = Path(list(spec.submodule_search_locations)[0])
    out = []
    for pattern in CP_SOURCES:
        for path in sorted(package.glob(pattern)):
            if path.name == "__init__.py":
                continue
            module = "nemo_automodel." + ".".join(path.relative_to(package).with_suffix("").parts)
            tree = ast.parse(path.read_text())
            out += [
                f"{module}.{node.name}"
                for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and not node.name.startswith("_")
            ]
    return out


def _adapter_claims() -> dict[str, list[tuple[str, str]]]:
    from examples.automodel.adapters import ADAPTERS

    claims: dict[str, list[tuple[str, str]]] = {}
    for adapter in ADAPTERS:
        try:
            module = importlib.import_module(f"examples.automodel.adapters.{adapter}")
        except Exception as exc:  # noqa: BLE001 - said in the table
            claims.setdefault(f"(adapter {adapter} does not import: {type(exc).__name__})", [])
            continue
        for documented, dotted in getattr(module, "SERVES", {}).items():
            claims.setdefault(dotted, []).append((f"adapter:{adapter}", f"serves {documented}"))
        for dotted, what in getattr(module, "ALSO_USES", {}).items():
            claims.setdefault(dotted, []).append((f"adapter:{adapter}", what))
    return claims


def spec_unmet(spec: str) -> str | None:
    """Why model spec ``spec`` cannot run here (its unmet ``REQUIRES``), ``None`` when it can."""
    from cp_harness.usage.model_specs import spec_traits

    unmet = spec_traits(f"examples.automodel.models.{spec}").unmet()
    return "; ".join(f"needs {key}: {why}" for key, why in unmet.items()) or None


def _spec_claims() -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
    from cp_harness.usage.model_specs import spec_traits
    from examples.automodel.models import SPECS

    claims: dict[str, list[tuple[str, str]]] = {}
    broken = {}
    for spec in SPECS:
        try:
            traits = spec_traits(f"examples.automodel.models.{spec}")
        except Exception as exc:  # noqa: BLE001 - said in the table
            broken[f"spec:{spec}"] = f"does not load: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            continue
        for dotted, what in traits.covers.items():
            claims.setdefault(dotted, []).append((f"spec:{spec}", what))
    return claims, broken


def _judges(path: Path) -> tuple[str, ...]:
    """A test module's ``JUDGES``: the subjects (``adapter:X`` / ``spec:X``) whose CP path its tests run and judge
    (read with ``ast``; a module that only loads or builds a subject does not list it)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "JUDGES" for t in node.targets):
            try:
                return tuple(ast.literal_eval(node.value))
            except ValueError:
                return ()
    return ()


def default_command_tests(subject: str) -> list[str]:
    """The test files of the default command (``tests/**/test_*.py``) whose ``JUDGES`` name ``subject``."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if subject in _judges(p))


def nightly_runs(subject: str) -> bool:
    """Whether the nightly GPU workflow runs ``subject``: ``real_clients --backend nccl`` runs every adapter and
    spec, a ``verify --model`` line its spec."""
    path = ROOT / ".github" / "workflows" / "nightly.yml"
    text = path.read_text() if path.is_file() else ""
    kind, name = subject.split(":", 1)
    if re.search(r"real_clients[^\n]*--backend nccl", text):
        return True
    return (
        kind == "spec"
        and re.search(rf"--model examples\.automodel\.models\.{re.escape(name)}(?![\w])", text) is not None
    )


def cpu_mode(subject: str) -> str:
    """How ``subject``'s CP path runs on a CPU (the default command and a CPU ``real_clients``): ``"real kernels"``
    (every line and kernel the framework's and torch's), ``"CPU, stand-in: ..."`` (each declared stand-in's
    report line), with ``"forward only"`` where gradients are not judged there, or ``"not on CPU (...)"``."""
    kind, name = subject.split(":", 1)
    if kind != "spec":
        return "real kernels"
    from cp_harness import standins
    from cp_harness.usage.model_specs import spec_traits

    traits = spec_traits(f"examples.automodel.models.{name}")
    if traits.unmet():
        return "not on CPU (" + "; ".join(f"needs {key}" for key in traits.unmet()) + ")"
    modes = [standins.get(n).description for n in traits.standins if standins.get(n).device_type == "cpu"]
    if traits.forward_only("cpu"):
        modes.append("forward only")
    return "; ".join(modes) or "real kernels"


@dataclasses.dataclass
class CoverageRow:
    function: str
    exercised_by: list[tuple[str, str]]  # (subject, what it does with the function)
    default_command: list[str]
    real_clients: list[str]
    nightly: list[str]
    why_not: str | None = None
    on_cpu: list[str] = dataclasses.field(default_factory=list)  # "subject: cpu_mode(subject)"


@dataclasses.dataclass
class CoverageTable:
    rows: list[CoverageRow]
    problems: dict[str, str]

    def as_dict(self) -> dict:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "problems": self.problems,
            "judged": sum(1 for r in self.rows if r.exercised_by),
            "functions": len(self.rows),
        }

    def markdown(self) -> str:
        lines = [
            f"{sum(1 for r in self.rows if r.exercised_by)} of {len(self.rows)} framework CP functions are "
            "exercised (generated by `examples/automodel/tools/coverage.py` from the adapters' `SERVES`, the specs' "
            "`COVERS`, the tests and the nightly workflow).",
            "",
            "| framework function | exercised by | default command | real_clients (this run) | on CPU | "
            "nightly GPU (real kernels) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            by = "; ".join(f"`{s}` ({what})" for s, what in r.exercised_by) or f"not judged: {r.why_not}"
            lines.append(
                f"| `{r.function}` | {by} | {', '.join(r.default_command) or '-'} | "
                f"{'; '.join(r.real_clients) or '-'} | {'; '.join(r.on_cpu) or '-'} | {'; '.join(r.nightly) or '-'} |"
            )
        lines += [f"- {what}: {why}" for what, why in self.problems.items()]
        return "\n".join(lines)

    def text(self) -> str:
        """The terminal's form: per framework module, the functions exercised and where; the rest counted."""
        by_module: dict[str, list[CoverageRow]] = {}
        for r in self.rows:
            by_module.setdefault(r.function.rsplit(".", 1)[0].removeprefix("nemo_automodel.components."), []).append(r)
        lines = [
            f"{sum(1 for r in self.rows if r.exercised_by)} of {len(self.rows)} framework CP functions "
            f"exercised (full table: summary.md)"
        ]
        for module, rows in by_module.items():
            judged = [r for r in rows if r.exercised_by]
            lines.append(f"  {module}: {len(judged)} of {len(rows)}")
            for r in judged:
                where = ", ".join(
                    filter(
                        None,
                        [
                            "default command" if r.default_command else "",
                            "real_clients: " + "; ".join(r.real_clients) if r.real_clients else "",
                            "on CPU: " + "; ".join(r.on_cpu) if r.on_cpu else "",
                            "nightly GPU" if r.nightly else "",
                        ],
                    )
                )
                lines.append(
                    f"    {r.function.rsplit('.', 1)[1]:<44} {', '.join(sorted({s for s, _ in r.exercised_by}))}"
                    f"  [{where or 'runs nowhere'}]"
                )
        lines += [f"  {what}: {why}" for what, why in self.problems.items()]
        return "\n".join(lines)


def _outcome(subject: str, summary: dict) -> str:
    if subject in summary.get("skipped", {}):
        return f"skipped here ({summary['skipped'][subject]})"
    entry = summary.get("subjects", {}).get(subject)
    if entry is None:
        return ""
    if not entry["failed_rows"]:
        return "passed"
    verdicts = [f for f in summary["findings"] if f["subject"] == subject]
    ids = sorted({f["defect"] for f in verdicts if f["defect"]})
    new = [f["row"] for f in verdicts if not f["defect"]]
    return ("NEW FINDING in " + ", ".join(new)) if new else f"failed as documented ({', '.join(ids)})"


def build(summary: dict, known: list[dict]) -> CoverageTable:
    """The table for the run described by ``summary`` (``examples.automodel.tools.run``)."""
    from examples.automodel.adapters import NOT_ADAPTED

    claims = _adapter_claims()
    spec_claims, problems = _spec_claims()
    for dotted, entries in spec_claims.items():
        claims.setdefault(dotted, []).extend(entries)
    functions = framework_functions()
    functions += sorted((set(claims) | set(NOT_ADAPTED)) - set(functions))
    modes = {s: cpu_mode(s) for entries in claims.values() for s, _ in entries if not s.startswith("(")}
    rows = []
    for function in functions:
        entries = claims.get(function, [])
        subjects = sorted({s for s, _ in entries})
        rows.append(
            CoverageRow(
                function,
                entries,
                sorted({t for s in subjects for t in default_command_tests(s)}),
                [f"{s}: {o}" for s in subjects if (o := _outcome(s, summary))],
                [s for s in subjects if nightly_runs(s)],
                None if entries else NOT_ADAPTED.get(function, "no adapter or spec exercises it"),
                [f"{s}: {modes[s]}" for s in subjects],
            )
        )
    return CoverageTable(rows, problems)
