"""The coverage table: every CP function of the installed framework, what exercises it, where it runs.

Generated, never written by hand, from what the code declares:

- the framework's CP code: every public top-level function and class of
  ``components/distributed/context_parallel/``, ``components/distributed/blockdiag_cp/`` and
  ``components/models/*/cp*.py`` (read from the installed sources with ``ast``: nothing is imported), plus every
  other callable an adapter or spec names;
- the CP-relevant training-step code (``TRAINING_SOURCES``, part "training step"): the recipe's losses, THD input
  processing, MTP target preparation, the mesh, the parallelizer and the FSDP patches it applies, the grad-
  accumulation and clip-grad helpers, plus the recipes' CP step methods (``training/covers.py``'s ``REBUILT``);
- what exercises it: each attention subject's ``COVERS`` (``examples/automodel/attention/``, subjects
  ``attention:<name>``), each adapter's ``SERVES`` (documented function -> framework callable) and ``ALSO_USES``
  (other framework callables its hooks run), each model spec's ``COVERS`` (framework callable -> what its CP
  path does with it), and the training-step driver's ``COVERS`` / ``REBUILT`` for the subjects
  ``training:<spec>`` (``run.TRAINING_STEP_SPECS``);
- where it runs: the **default command** (the test files under ``tests/`` whose ``JUDGES`` name the adapter or
  spec: the subjects whose CP path they run and judge),
  **real_clients** (this run: passed, failed as documented, a new finding, or skipped with the spec's unmet
  ``REQUIRES``) and the **nightly GPU** job (``.github/workflows/nightly.yml``: ``real_clients --backend nccl`` runs
  every adapter, ``verify --model`` lines name the specs), and **on CPU**, how the subjects' CP paths run in the
  two CPU places: on the framework's and torch's own kernels, on a kernel stand-in (``cp_harness.standins``,
  the spec's ``STANDINS``: "CPU, stand-in: ..."), forward only (the spec's ``FORWARD_ONLY_ON``), or not at all
  (unmet ``REQUIRES``); the nightly GPU runs the real kernels;
- why a function is not judged: ``examples.automodel.adapters.NOT_ADAPTED`` (looked at, and why no adapter fits) or
  ``training/covers.py``'s ``NOT_RUN``, else "no adapter or spec exercises it".
"""

from __future__ import annotations

import ast
import dataclasses
import functools
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
# The training step's CP-relevant modules (issue 34): the losses train_ft's step can use (the distillation and
# retrieval losses of loss/ belong to other recipes), THD input processing, MTP's CP target preparation, the mesh,
# the parallelizer and the FSDP2 patches it applies, and the step helpers of components/training/utils.py.
TRAINING_SOURCES = (
    "components/loss/masked_ce.py",
    "components/loss/linear_ce_base.py",
    "components/loss/chunked_ce.py",
    "components/loss/linear_ce.py",
    "components/loss/te_parallel_ce.py",
    "components/loss/mtp.py",
    "components/loss/utils.py",
    "components/loss/dist_utils.py",
    "components/distributed/thd_utils.py",
    "components/models/common/mtp/*.py",
    "components/distributed/mesh.py",
    "components/distributed/mesh_utils.py",
    "components/distributed/model_parallelizer.py",
    "components/distributed/fsdp_patches.py",
    "components/distributed/utils.py",
    "components/training/utils.py",
)
PARTS = {"CP": CP_SOURCES, "training step": TRAINING_SOURCES}


def framework_functions(sources: tuple[str, ...] = CP_SOURCES) -> list[str]:
    """Dotted paths of the public top-level functions and classes of the framework modules matching ``sources``
    (globs under the installed package; read with ``ast``, sources only), each once (``typing.overload``
    definitions repeat a name), in file order."""
    spec = importlib.util.find_spec("nemo_automodel")
    if spec is None or not spec.submodule_search_locations:
        return []
    package = Path(list(spec.submodule_search_locations)[0])
    out: list[str] = []
    for pattern in sources:
        for path in sorted(package.glob(pattern)):
            if path.name == "__init__.py":
                continue
            module = "nemo_automodel." + ".".join(path.relative_to(package).with_suffix("").parts)
            tree = ast.parse(path.read_text())
            for node in tree.body:
                dotted = f"{module}.{getattr(node, 'name', '')}"
                if (
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and not node.name.startswith("_")
                    and dotted not in out
                ):
                    out.append(dotted)
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


def spec_unmet(module: str) -> str | None:
    """Why the model spec in dotted module ``module`` cannot run here (its unmet ``REQUIRES``), ``None`` when it
    can. A module, not a bare name: the framework's specs and torchtitan's live in different packages."""
    from cp_harness.usage.model_specs import spec_traits

    unmet = spec_traits(module).unmet()
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


def _training_claims() -> dict[str, list[tuple[str, str]]]:
    """The training-step driver's ``COVERS``, one subject ``training:<spec>`` per spec whose step the gate runs
    (the linear-CE and MTP entries only for the specs those rows run)."""
    from cp_harness.checks.training_step import LINEAR_CE_UNSUPPORTED
    from examples.automodel.tools.run import TRAINING_STEP_SPECS
    from examples.automodel.training import covers

    claims: dict[str, list[tuple[str, str]]] = {}
    for spec in TRAINING_STEP_SPECS:
        losses = ["masked"] + ["linear_ce"] * (spec not in LINEAR_CE_UNSUPPORTED)
        losses += ["mtp"] * (spec in covers.COVERS_MTP_BY_SPEC)  # the specs whose MTP rows run
        for dotted, what in {k: v for loss in losses for k, v in covers.covers(loss, spec).items()}.items():
            claims.setdefault(dotted, []).append((f"training:{spec}", what))
    return claims


def _attention_claims() -> dict[str, list[tuple[str, str]]]:
    """Each attention subject's ``COVERS`` (``examples/automodel/attention/``), as subject ``attention:<name>``."""
    from examples.automodel.attention import PACKAGE, SUBJECTS

    claims: dict[str, list[tuple[str, str]]] = {}
    for subject in SUBJECTS:
        try:
            module = importlib.import_module(f"{PACKAGE}.{subject}")
        except Exception as exc:  # noqa: BLE001 - said in the table
            claims.setdefault(f"(attention subject {subject} does not import: {type(exc).__name__})", [])
            continue
        for dotted, what in getattr(module, "COVERS", {}).items():
            claims.setdefault(dotted, []).append((f"attention:{subject}", what))
    return claims


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


@functools.cache
def _all_judges() -> dict[str, tuple[str, ...]]:
    """Every test file of the default command (``tests/**/test_*.py``, relative path) -> its ``JUDGES``, read once
    per process (``build`` asks for every row's subjects: parsing the files each time took minutes)."""
    return {str(p.relative_to(ROOT)): _judges(p) for p in sorted((ROOT / "tests").rglob("test_*.py"))}


def default_command_tests(subject: str) -> list[str]:
    """The test files of the default command (``tests/**/test_*.py``) whose ``JUDGES`` name ``subject``."""
    return [path for path, judges in _all_judges().items() if subject in judges]


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
    if kind == "training":
        # The step on gloo takes all_gather's NCCL backward (finding D2): a stand-in of the step, said as one.
        from examples.automodel.training.train_ft_step import STAND_IN

        model = cpu_mode(f"spec:{name}")
        return "; ".join(m for m in (model if model != "real kernels" else "", f"CPU, stand-in: {STAND_IN}") if m)
    from cp_harness import standins

    if kind == "adapter":  # an adapter module's STANDINS (the framework code it serves calls a device kernel)
        module = importlib.import_module(f"examples.automodel.adapters.{name}")
        stood_in = [standins.get(n) for n in getattr(module, "STANDINS", ())]
        return "; ".join(s.description for s in stood_in if s.device_type == "cpu") or "real kernels"
    if kind == "attention":
        from examples.automodel.attention import PACKAGE

        declared = getattr(importlib.import_module(f"{PACKAGE}.{name}"), "STANDINS", ())
        return "; ".join(standins.get(n).description for n in declared if standins.get(n).device_type == "cpu") or (
            "real kernels"
        )
    if kind != "spec":
        return "real kernels"
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
    part: str = "CP"  # "CP" (the CP modules) or "training step" (TRAINING_SOURCES and the recipes' step methods)


@dataclasses.dataclass
class CoverageTable:
    rows: list[CoverageRow]
    problems: dict[str, str]

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per part (``"CP"``, ``"training step"``): (functions exercised, functions)."""
        return {
            part: (
                sum(1 for r in self.rows if r.part == part and r.exercised_by),
                sum(r.part == part for r in self.rows),
            )
            for part in PARTS
        }

    def as_dict(self) -> dict:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "problems": self.problems,
            "judged": sum(1 for r in self.rows if r.exercised_by),
            "functions": len(self.rows),
            "by_part": {part: {"judged": j, "functions": n} for part, (j, n) in self.counts().items()},
        }

    def _headline(self) -> str:
        return ", ".join(f"{j} of {n} framework {part} functions" for part, (j, n) in self.counts().items())

    def markdown(self) -> str:
        lines = [
            f"{self._headline()} are exercised (generated by `examples/automodel/tools/coverage.py` from the "
            "adapters' `SERVES`, the specs' `COVERS`, the training-step driver's `COVERS`, the tests and the nightly "
            "workflow).",
            "",
            "| framework function | part | exercised by | default command | real_clients (this run) | on CPU | "
            "nightly GPU (real kernels) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            by = "; ".join(f"`{s}` ({what})" for s, what in r.exercised_by) or f"not judged: {r.why_not}"
            lines.append(
                f"| `{r.function}` | {r.part} | {by} | {', '.join(r.default_command) or '-'} | "
                f"{'; '.join(r.real_clients) or '-'} | {'; '.join(r.on_cpu) or '-'} | {'; '.join(r.nightly) or '-'} |"
            )
        lines += [f"- {what}: {why}" for what, why in self.problems.items()]
        return "\n".join(lines)

    def text(self) -> str:
        """The terminal's form: per framework module, the functions exercised and where; the rest counted."""
        by_module: dict[str, list[CoverageRow]] = {}
        for r in self.rows:
            by_module.setdefault(r.function.rsplit(".", 1)[0].removeprefix("nemo_automodel.components."), []).append(r)
        lines = [f"{self._headline()} exercised (full table: summary.md)"]
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
    from examples.automodel.training.covers import NOT_RUN, REBUILT

    claims = _adapter_claims()
    spec_claims, problems = _spec_claims()
    for extra in (spec_claims, _training_claims(), _attention_claims()):
        for dotted, entries in extra.items():
            claims.setdefault(dotted, []).extend(entries)
    cp, training = framework_functions(), framework_functions(TRAINING_SOURCES)
    named = set(claims) | set(NOT_ADAPTED) | set(NOT_RUN) | set(REBUILT)
    # A named callable outside both source sets belongs to the training step when only training subjects name it.
    training_named = {
        d
        for d in named - set(cp)
        if d in NOT_RUN or d in REBUILT or (d in claims and all(s.startswith("training:") for s, _ in claims[d]))
    }
    cp += sorted(named - set(cp) - set(training) - training_named)
    training = [f for f in training if f not in cp] + sorted(training_named - set(training))
    functions = cp + training
    part_of = dict.fromkeys(training, "training step")
    not_judged = {**NOT_ADAPTED, **NOT_RUN, **REBUILT}
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
                None if entries else not_judged.get(function, "no adapter or spec exercises it"),
                [f"{s}: {modes[s]}" for s in subjects],
                part_of.get(function, "CP"),
            )
        )
    return CoverageTable(rows, problems)
