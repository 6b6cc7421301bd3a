"""What only the nightly job runs catches no defect that the pull-request gate does not (issue 36, item 3).

Tests marked ``nightly`` are skipped by the default command (``conftest.py`` gives the marker's reason). A module
that holds one may not name a defect fixture (a module of ``tests/fixtures``: broken implementations, specs and
subjects), a framework adapter or a model spec: each of those is judged by name, so a nightly test that named one
could be the only test to catch it. The nightly fresh-environment repro test reaches the fixtures only through
``tests/repro/test_repros.py``'s ``export_targets``, whose default-command test exports and runs the same scripts.
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


def _modules_with_nightly_tests() -> list[Path]:
    return sorted(
        path
        for folder in (ROOT / "tests", ROOT / "cp_harness" / "tests")
        for path in folder.rglob("test_*.py")
        if path != Path(__file__).resolve() and NIGHTLY.search(path.read_text())
    )


def _named(text: str, names: set[str]) -> list[str]:
    return sorted(name for name in names if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text))


def test_no_module_with_a_nightly_test_names_a_defect_fixture_an_adapter_or_a_model_spec():
    names = _defect_names()
    assert len(names) > 40, names  # the folders moved: this test would check nothing
    modules = _modules_with_nightly_tests()
    assert {m.relative_to(ROOT).as_posix() for m in modules} >= {
        "tests/ranks/test_nodes.py",
        "tests/project/test_platforms.py",
    }, modules
    for module in modules:
        text = module.read_text()
        # The test files such a module runs in a pytest of its own (test_platforms) are held to the same rule.
        ran = [ROOT / rel for rel in re.findall(r"[\"'](tests/[\w/]+\.py)[\"']", text) if (ROOT / rel).is_file()]
        for path in [module, *ran]:
            assert not _named(path.read_text(), names), (
                f"{path.relative_to(ROOT)} (run by the nightly tests of {module.relative_to(ROOT)}) names "
                f"{_named(path.read_text(), names)}: a nightly-only test must not be the one to catch a defect; keep "
                f"the test in the default command or judge that defect in a test the default command runs"
            )


def test_the_check_sees_a_fixture_named_in_a_nightly_module(tmp_path):
    text = 'pytestmark = pytest.mark.nightly\nIMPL = "broken_gate_halo"\n'
    assert NIGHTLY.search(text) and _named(text, _defect_names()) == ["broken_gate_halo"]
    assert _named('IMPL = "broken_gate_halo_2"\nfrom x.broken_gate_halo import y', _defect_names()) == []
