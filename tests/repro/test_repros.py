"""Standalone repros (``cp_harness/repro``, issue 27): a failing case as one script needing torch, numpy and the code
under test only.

- Every broken fixture of ``tests/fixtures`` (``targets.FIXTURES``) and every documented framework defect
  (``known_defects.json``) is exported from a case it fails (a documented case with its documented signature, as
  ``scripts/real_clients`` replays it); each script imports nothing but the standard
  library, torch, numpy and the code under test, carries the SHA-256 of its pickle-free ``.npz``, exits 1 on the
  broken code (printing the wrong tensor, its rank and global position) and 0 on the bundled implementation
  (``--impl cp_impl``) or with ``--fixed``; run with ``cp_harness``, ``oracle`` and ``hypothesis`` unimportable
  (``run_scripts.py``), the ranks forked from one interpreter. A fresh virtual environment holding only torch,
  numpy and the code under test runs them as their users do in the nightly (``test_fresh_venv.py``).
- The committed repros of the documented defects (``examples/automodel/repro/exported``) are what the exporter
  writes now.
- ``verify --export-repros DIR`` leaves one script per failing row in DIR and names it in the report; the
  plugin's runner (``--cp-export-repros``) names the script in a failure's message; ``python -m cp_harness repro``
  writes one.
"""

from __future__ import annotations

import ast
import contextlib
import filecmp
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from targets import FIXTURES, NEEDS_FRAMEWORK, WAITS_FOR_A_MESSAGE

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "run_scripts.py"
EXPORTED = ROOT / "examples" / "automodel" / "repro" / "exported"
ALLOWED = set(sys.stdlib_module_names) | {"numpy", "torch", "nemo_automodel"}


@functools.cache
def framework() -> bool:
    """Whether the framework's sharder imports; asked by the tests that use it, not at collection (the import costs
    each pytest worker over a second, and only the worker that runs the exports needs it)."""
    try:
        import nemo_automodel.components.distributed.context_parallel.sharder  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def export_targets(cp_runner, own_pool_runner, tmp_path_factory, framework_adapters=None,
                   on_export=None) -> dict[str, Path]:
    """Every target exported from its failing case: ``{name: script}``; the documented defects as
    ``examples.automodel.tools.export_repros`` names them (in a folder of their own). The fixtures run on a pool
    that imported them (``own_pool_runner``, tests/conftest.py), the documented defects (and the fixtures that need the framework) on
    ``framework_adapters`` (tests/conftest.py; else one like it); the session's pool is left as it was.
    ``on_export(script)``: called with each script as soon as it is written."""
    out: dict[str, Path] = {}
    directory = tmp_path_factory.mktemp("repros")
    fixtures = {name: case for name, (case, _) in FIXTURES.items()
                if (framework() or name not in NEEDS_FRAMEWORK) and int(case["world_size"]) <= cp_runner.config.world_size}

    def export(runner, names: list[str]) -> None:
        for name in names:
            report = runner.run({**fixtures[name], "impl": name})
            assert not report.ok, name
            # not NAME.py: run as a script, its folder comes first on sys.path and `import NAME` would import itself
            result = runner.export_repro({**fixtures[name], "impl": name}, report, str(directory), name=f"{name}-repro")
            assert result.path, f"{name}: {result.why}"
            out[name] = Path(result.path)
            if on_export is not None:
                on_export(out[name])

    alone = [name for name in fixtures if name not in NEEDS_FRAMEWORK]
    with own_pool_runner([fixtures[n] for n in alone], alone) as runner:
        export(runner, alone)
    if framework():
        from examples.automodel.tools import export_repros
        from examples.automodel.tools.defects import Failure

        entries = export_repros.entries()
        adapters = sorted({f"examples.automodel.adapters.{e['adapter']}" for e in entries})
        framed = [name for name in fixtures if name in NEEDS_FRAMEWORK]
        with contextlib.ExitStack() as stack:
            runner = framework_adapters.sharing_pool() if framework_adapters is not None else stack.enter_context(
                own_pool_runner([e["case"] for e in entries], adapters))
            export(runner, framed)
            defects = tmp_path_factory.mktemp("defects")
            def exported(entry, report, result):
                # the documented case still fails through the harness, with its documented signature (what
                # scripts/real_clients replays; this is that replay for every adapter row, on the same run)
                assert entry["signature"].matches(Failure.of_report(report)), (
                    f"{entry['id']} ({entry['adapter']} / {entry['row']}) fails differently now: "
                    + "; ".join([p.message for p in report.problems] + [c.name for c in report.failures()]))
                assert result.path, f"{entry['name']}: {result.why}"
                out[entry["name"]] = Path(result.path)
                if on_export is not None:
                    on_export(out[entry["name"]])

            export_repros.export_all(runner, str(defects), exported)
    return out


def _every_fixture_and_documented_defect_has_a_script(exported):
    expected = {n for n, (c, _) in FIXTURES.items() if framework() or n not in NEEDS_FRAMEWORK}
    assert expected <= set(exported), sorted(expected - set(exported))
    if framework():
        from examples.automodel.tools import export_repros

        assert {e["name"] for e in export_repros.entries()} <= set(exported)


def _a_script_imports_only_torch_numpy_and_the_code_under_test(exported):
    for name, path in exported.items():
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported <= ALLOWED, f"{name}: {sorted(imported - ALLOWED)}"
        text = path.read_text()
        assert not re.search(r"\b(cp_harness|oracle|hypothesis)\b", text.split('"""', 2)[2]), name  # beyond the docstring
        if name in FIXTURES:  # the implementation under test is imported by name, by default the broken one
            assert f'default={name!r}' in text, name


def _a_scripts_arrays_are_pickle_free_and_sealed_by_its_digest(exported):
    for name, path in exported.items():
        npz = path.with_suffix(".npz")
        if not npz.exists():
            continue
        data = npz.read_bytes()
        assert f"SHA256 = {hashlib.sha256(data).hexdigest()!r}" in path.read_text(), name
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            assert all(arrays[k].dtype != object for k in arrays.files), name
            assert all(k in arrays.files for k in arrays.get("bfloat16", [])), name


# Lines of a script written by the harness (the shared parts, the family's body, its docstring), the code under test
# copied in (an adapter's translation, its sharder) and the fix it ships (FixedGather) not counted; a script on a
# world mesh holds the mesh built as training builds it and a paragraph saying so.
LIMITS = {"call": 195, "sharding": 305}
WORLD_MESH_LINES = 15


def _harness_definitions() -> set[str]:
    names = {"options", "code_under_test", "call"}  # written per script by the family
    for module in (ROOT / "cp_harness" / "repro").glob("*.py"):
        if module.name != "fixes.py":
            names |= {n.name for n in ast.parse(module.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


def _own_lines(path: Path, harness: set[str]) -> int:
    text = path.read_text()
    copied = [n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name not in harness]
    return len(text.splitlines()) - sum(n.end_lineno - n.lineno + 3 for n in copied)  # two blank lines before each


def _scripts_are_small(exported):
    harness, sizes, over = _harness_definitions(), {}, {}
    for name, path in exported.items():
        text = path.read_text()
        family = "sharding" if "def shard(" in text else "call"
        limit = LIMITS[family] + (WORLD_MESH_LINES if "MESH = {" in text else 0)
        sizes[name] = (len(text.splitlines()), _own_lines(path, harness), family)
        if sizes[name][1] > limit:
            over[name] = (*sizes[name], limit)
    assert not over, over
    print("script lines (all, the harness's own, family):", json.dumps(sizes))


class ScriptRuns:
    """Each exported script's command lines, run without the harness (``run_scripts.py``) while the exports go on:
    a script's runs are sent as soon as it is written. Two interpreters: one for the scripts on a world mesh, whose
    broken run may wait for its ``--timeout`` (a message sent to the wrong rank is never received), one for the
    rest; neither that wait nor the interpreters' start adds to the exports' time."""

    def __init__(self, blocked: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fixtures"), str(ROOT)])}
        self.lanes = {lane: subprocess.Popen([sys.executable, str(RUNNER)], cwd=ROOT, env=env, text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                      for lane in ("mesh", "other")}
        self.out: dict[str, list[str]] = {lane: [] for lane in self.lanes}
        self.err: dict[str, list[str]] = {lane: [] for lane in self.lanes}
        self.readers = [threading.Thread(target=sink.extend, args=(stream,), daemon=True)
                        for lane, proc in self.lanes.items()
                        for sink, stream in ((self.out[lane], proc.stdout), (self.err[lane], proc.stderr))]
        for reader in self.readers:
            reader.start()
        self.sent: list[tuple[str, Path, list[str]]] = []
        self._send("other", blocked, [])

    def _send(self, lane: str, path: Path, args: list[str]) -> None:
        self.sent.append((lane, path, args))
        stdin = self.lanes[lane].stdin
        assert stdin is not None
        stdin.write(json.dumps([str(path), args]) + "\n")
        stdin.flush()

    def script(self, path: Path) -> None:
        """Send ``path``'s runs: as it is, with ``--impl cp_impl`` and, where it ships one, ``--fixed``."""
        text = path.read_text()
        mesh = "MESH = {" in text
        # a message to the wrong rank waits for the script's timeout (120 s by default): a short one here, and
        # for the broken run of a script whose documented failure is that wait, one that ends it soon
        wait = ["--timeout", "20"] if mesh else []
        broken = ["--timeout", "3"] if path.stem.removesuffix("-repro") in WAITS_FOR_A_MESSAGE else wait
        for args in ([*broken], ["--impl", "cp_impl", *wait], *([["--fixed", *wait]] if "--fixed" in text else [])):
            self._send("mesh" if mesh else "other", path, args)

    def results(self) -> list[tuple[Path, list[str], dict]]:
        """Every run in the order sent: ``(script, args, {"exit", "output", "seconds", ...})``."""
        for proc in self.lanes.values():
            assert proc.stdin is not None
            proc.stdin.close()
        for lane, proc in self.lanes.items():
            try:
                proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {lane} scripts' runner did not finish within 900 s after its last script; its last "
                            f"run: {self.out[lane][-1:] or 'none'}; stderr: {''.join(self.err[lane])[-2000:]}")
        for reader in self.readers:
            reader.join()
        done = {lane: [json.loads(line) for line in self.out[lane]] for lane in self.lanes}
        for lane in self.lanes:
            expected = sum(1 for sent_lane, _, _ in self.sent if sent_lane == lane)
            assert len(done[lane]) == expected, "".join(self.out[lane])[-2000:] + "".join(self.err[lane])[-4000:]
        taken = {lane: iter(results) for lane, results in done.items()}
        return [(path, args, next(taken[lane])) for lane, path, args in self.sent]

    def close(self) -> None:
        """End the runners that are still running (a check failed before their results were read)."""
        for proc in self.lanes.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _each_script_fails_on_the_broken_code_and_passes_on_the_fix_without_the_harness(runs):
    results = runs.results()
    blocked = results[0][2]
    assert blocked["exit"] == 3 and "cp_harness is not available" in blocked["output"], blocked
    for path, args, result in results[1:]:
        name, output = path.stem.removesuffix("-repro"), result["output"]
        if set(args) & {"--impl", "--fixed"}:
            assert result["exit"] == 0, f"{name} {args}:\n{output}"
            continue
        assert result["exit"] == 1, f"{name}:\n{output}"
        says = FIXTURES[name][1] if name in FIXTURES else ""
        assert says in output and re.search(r"differ|raised|holds no|changed the caller's|cuts|not sharded", output), output
        if "position" in output and "differ" in output:
            assert re.search(r"position -?\d+", output), output
    print("seconds per run:", json.dumps({r["script"].rsplit("/", 1)[-1] + " " + " ".join(r["args"]): r["seconds"]
                                          for _, _, r in results[1:]}))


def _the_committed_repros_of_the_documented_defects_are_current(exported):
    if not framework():
        return
    from examples.automodel.tools import export_repros

    for entry in export_repros.entries():
        script = exported[entry["name"]]
        for suffix in (".py", ".npz"):
            committed = EXPORTED / (entry["name"] + suffix)
            assert committed.exists() and filecmp.cmp(script.with_suffix(suffix), committed, shallow=False), \
                f"{committed.name} is stale: python -m examples.automodel.tools.export_repros"
    d1 = (EXPORTED / "D1-deepseek_v41_gather-model.mistral_large4.float64.py").read_text()
    assert "reaches the call as a permuted view" in d1  # D1: the upstream gradient's strides are the finding


@pytest.mark.slow
def test_every_fixture_and_documented_defect_exports_a_standalone_repro_that_fails_then_passes(
        cp_runner, own_pool_runner, framework_adapters, tmp_path_factory):
    """One test, so that pytest-xdist runs the exports once and each script's command lines while the next one is
    exported (``ScriptRuns``)."""
    blocked = tmp_path_factory.mktemp("run") / "uses_the_harness.py"
    blocked.write_text("import cp_harness\n\n\ndef main(argv):\n    return 0\n")
    runs = ScriptRuns(blocked)
    try:
        exported = export_targets(cp_runner, own_pool_runner, tmp_path_factory, framework_adapters, runs.script)
        _every_fixture_and_documented_defect_has_a_script(exported)
        _a_script_imports_only_torch_numpy_and_the_code_under_test(exported)
        _a_scripts_arrays_are_pickle_free_and_sealed_by_its_digest(exported)
        _scripts_are_small(exported)
        _the_committed_repros_of_the_documented_defects_are_current(exported)
        _each_script_fails_on_the_broken_code_and_passes_on_the_fix_without_the_harness(runs)
    finally:
        runs.close()


def test_verify_export_repros_leaves_one_script_per_failing_row_and_names_it(cp_runner, tmp_path):
    from cp_harness.verify import VerifySettings, result_text, run_verify

    settings = VerifySettings(impl="broken_gate_halo", world_sizes=(2, 3), examples=2, shrink_seconds=1.0,
                              rows=("convolution_history", "gather_sequence"), dtypes=("float64",),
                              export_repros=str(tmp_path / "repros"), error_dir=str(tmp_path / "maps"))
    result = run_verify(settings, pool=cp_runner.pool, progress_stream=io.StringIO())
    text, report = result_text(result), result.as_dict()
    failed = [row for row in report["rows"] if not row["ok"]]
    assert [row["name"] for row in failed] == ["inkling2.convolution_history"], text
    scripts = sorted(p.name for p in (tmp_path / "repros").glob("*.py"))
    assert len(scripts) == len(failed) and failed[0]["repro_script"].endswith(scripts[0]), (scripts, text)
    assert f"standalone repro: {failed[0]['repro_script']}" in text, text
    assert all(row["repro_script"] is None for row in report["rows"] if row["ok"])


def test_the_plugins_runner_names_the_script_of_a_failing_case(cp_runner, tmp_path):
    runner = cp_runner.sharing_pool()
    runner.repro_dir = str(tmp_path)
    case, _ = FIXTURES["broken_rel_loss_scale"]
    with pytest.raises(AssertionError) as failure:
        runner.check({**case, "impl": "broken_rel_loss_scale"})
    path = re.search(r"standalone repro: (\S+\.py)", str(failure.value)).group(1)
    assert Path(path).is_file() and Path(path).with_suffix(".npz").is_file()
    from cp_harness import options

    assert options.BY_DEST["export_repros"].plugin and options.BY_DEST["export_repros"].pytest_flag == \
        "--cp-export-repros"


def test_the_repro_command_writes_the_script_of_a_failing_case(tmp_path, capsys):
    from cp_harness.__main__ import main

    case, _ = FIXTURES["broken_rel_loss_scale"]
    out = tmp_path / "loss.py"
    assert main(["repro", "--impl", "broken_rel_loss_scale", json.dumps(case), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"standalone repro: {out}" in printed and out.is_file() and out.with_suffix(".npz").is_file(), printed


def test_the_repro_command_refuses_a_script_named_like_the_module_it_imports(tmp_path, capsys):
    from cp_harness.__main__ import main

    case, _ = FIXTURES["broken_rel_loss_scale"]
    out = tmp_path / "broken_rel_loss_scale.py"
    assert main(["repro", "--impl", "broken_rel_loss_scale", json.dumps(case), "-o", str(out)]) == 2
    assert "would import the script instead of the module under test" in capsys.readouterr().err
    assert not out.exists()
