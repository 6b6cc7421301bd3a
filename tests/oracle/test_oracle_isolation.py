"""The oracles and the implementation import nothing from each other (nor the oracles from the harness)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

FORBIDDEN = ("cp_impl", "cp_harness")
ROOT = pathlib.Path(__file__).resolve().parents[2]
ORACLE = ROOT / "oracle"


def test_importing_the_oracles_loads_no_forbidden_module():
    code = (
        "import sys, oracle, oracle.layout, oracle.attention, oracle.convolution, oracle.loss, oracle.models; "
        "bad=[m for m in sys.modules if m.split('.')[0] in ('cp_impl','cp_harness')]; assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _imported_modules(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            names += [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    return names


def test_oracle_sources_do_not_import_the_implementation():
    sources = sorted(ORACLE.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "layout.py", "attention.py", "convolution.py", "loss.py", "models.py"}
    offending = [
        f"{path.name}: {name}"
        for path in sources
        for name in _imported_modules(path)
        if name.split(".")[0] in FORBIDDEN
    ]
    assert not offending, offending
    for path in sources:  # also dynamic or textual references
        text = path.read_text()
        for word in FORBIDDEN:
            assert f"import {word}" not in text and f"from {word}" not in text, (path.name, word)


def test_implementation_sources_do_not_import_the_oracles_or_the_harness():
    """The other direction: ``cp_impl`` is judged by the oracles, so it must not use them."""
    sources = sorted((ROOT / "cp_impl").glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "inkling2.py", "mistral_large4.py", "sharder.py"}
    offending = [f"{path.name}: {name}" for path in sources for name in _imported_modules(path)
                 if name.split(".")[0] in ("oracle", "cp_harness")]
    assert not offending, offending
    code = ("import sys, cp_impl, cp_impl.inkling2, cp_impl.mistral_large4, cp_impl.sharder; "
            "bad=[m for m in sys.modules if m.split('.')[0] in ('oracle','cp_harness')]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
