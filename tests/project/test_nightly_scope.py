"""What only the nightly job runs catches no defect that the pull-request gate does not (issue 36, item 3).

Tests marked ``nightly`` are skipped by the default command (``conftest.py`` gives the marker's reason). Defect
fixtures (the modules of ``tests/fixtures``: broken implementations, specs and subjects), framework adapters and model
specs are judged by name, so every one that a module holding a nightly test names must also be named by a module
whose tests all run in the default command. Names reached through helpers are not seen: the nightly fresh-environment
repro test reaches the fixtures through ``tests/repro/test_repros.py``'s ``export_targets``, whose default-command
test exports and runs the same scripts (the real-model specs' scripts, run there only, are of fixtures that the
default command's real-model tests catch).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NIGHTLY = re.compile(r"pytest\.mark\.nightly\b")


def _defect_names() -> set[str]:
    folders = [
        ROOT / "tests" / "fixtures",
        ROOT / "examples" / "automodel" / "adapters",
        ROOT / "examples" / "automodel" / "models",
    ]
    return {
        path.stem
        for folder in folders
        for path in folder.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").is_file()) and not path.stem.startswith("_")
    }


def _test_modules() -> tuple[list[Path], list[Path]]:
    """``(modules holding a nightly test, modules whose tests all run in the default command)``, each file read once."""
    nightly, default = [], []
    for folder in (ROOT / "tests", ROOT / "cp_harness" / "tests"):
        for path in sorted(folder.rglob("test_*.py")):
            if path != Path(__file__).resolve():
                (nightly if NIGHTLY.search(path.read_text()) else default).append(path)
    return nightly, default


def _named(text: str, names: set[str]) -> list[str]:
    """The ``names`` that ``text`` holds as whole identifiers (one scan: ``text`` split into its identifiers)."""
    return sorted(names & set(re.findall(r"\w+", text)))


def test_every_defect_a_nightly_module_names_is_named_by_a_test_the_default_command_runs():
    names = _defect_names()
    assert len(names) > 40, names  # the folders moved: this test would check nothing
    modules, default = _test_modules()
    assert {m.relative_to(ROOT).as_posix() for m in modules} >= {
        "tests/ranks/test_nodes.py",
        "tests/project/test_platforms.py",
    }, modules
    judged = set()
    for path in default:
        judged.update(_named(path.read_text(), names))
    for module in modules:
        text = module.read_text()
        # The test files such a module runs in a pytest of its own (test_platforms) are held to the same rule.
        ran = [ROOT / rel for rel in re.findall(r"[\"'](tests/[\w/]+\.py)[\"']", text) if (ROOT / rel).is_file()]
        for path in [module, *ran]:
            alone = sorted(set(_named(path.read_text(), names)) - judged)
            assert not alone, (
                f"{path.relative_to(ROOT)} (run by the nightly tests of {module.relative_to(ROOT)}) names {alone}, "
                f"which no test of the default command names: a nightly-only test must not be the one to catch a "
                f"defect; keep the test in the default command or judge that defect in a test the default command runs"
            )


def test_the_check_sees_a_fixture_named_in_a_nightly_module(tmp_path):
    text = 'pytestmark = pytest.mark.nightly\nIMPL = "broken_gate_halo"\n'
    assert NIGHTLY.search(text) and _named(text, _defect_names()) == ["broken_gate_halo"]
    assert _named("from examples.automodel.adapters.framework_sharder import x", _defect_names()) == [
        "framework_sharder"
    ]
    assert _named('IMPL = "broken_gate_halo_2"', _defect_names()) == []
