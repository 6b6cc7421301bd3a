"""Model specs: real framework models that a CP driver builds, shards the framework's way and compares.

Each module here that declares ``NAME`` (its own module name) is a *model spec* (the interface: ``_base``, whose
helpers every spec composes; ``model_owned_cp`` holds what the specs of models owning their CP attention share,
``_kimi_mla`` what the two Kimi specs share).
``SPECS`` is found by reading this folder, in name order, so a new spec is one more module and a page in
``docs/models/``; which of them need a GPU is what each declares in ``REQUIRES`` (``"cuda"``: ``needs_cuda``).
Importing a spec needs the framework's model dependencies (the ``models`` extra), not only torch; importing this
package does not. Tools that drive a spec without the gate: ``tools/run_standalone.py`` (CP 1, 2, 3 on forked gloo
ranks), ``tools/covers_check.py`` (a spec's ``COVERS`` counted under CP), ``tools/calibrate_spec.py`` (worst CP
errors, spreads and error/bound per dtype over drawn cases).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = __name__


def _declares_own_name(path: Path) -> bool:
    """Whether the module at ``path`` assigns ``NAME = "<its module name>"`` at top level (read, not imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NAME" for t in node.targets):
            return isinstance(node.value, ast.Constant) and node.value.value == path.stem
    return False


# The model specs ``scripts/real_clients`` gates (those whose ``REQUIRES`` is unmet here are skipped, with it, and run
# by the nightly GPU job).
SPECS: tuple[str, ...] = tuple(
    sorted(
        path.stem
        for path in Path(__file__).parent.glob("*.py")
        if not path.stem.startswith("_") and _declares_own_name(path)
    )
)


def _sibling(node: ast.ImportFrom) -> str | None:
    """The module of this package that ``from <module> import ...`` names, or ``None`` for any other module."""
    if node.level == 1 and node.module:
        return node.module
    if node.level == 0 and node.module and node.module.startswith(f"{PACKAGE}."):
        return node.module[len(PACKAGE) + 1 :]
    return None


def _declared_requirements(name: str, depth: int = 0) -> set[str] | None:
    """The keys of module ``name``'s ``REQUIRES`` read from the source, not imported: its one top-level dict
    literal, or what it takes from another module of this package (``from .x import REQUIRES`` or ``*``); ``set()``
    when neither gives it one; ``None`` when only importing it can tell (a computed or modified ``REQUIRES``)."""
    path = Path(__file__).with_name(f"{name}.py")
    if depth > 4 or not path.is_file():
        return None
    tree = ast.parse(path.read_text())
    assigned: list[ast.expr | None] = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript):
                target = target.value  # REQUIRES[...] = ...
            if getattr(target, "id", None) == "REQUIRES":
                assigned.append(getattr(node, "value", None))
    if assigned:
        literal = assigned[0]
        if len(assigned) > 1 or not isinstance(literal, ast.Dict):
            return None
        keys = [k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None for k in literal.keys]
        return None if None in keys else {str(k) for k in keys}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name in ("REQUIRES", "*") for a in node.names):
            sibling = _sibling(node)
            if sibling is None:
                return None
            found = _declared_requirements(sibling, depth + 1)
            if found != set() or any(a.name == "REQUIRES" for a in node.names):
                return found
    return set()


def needs_cuda(name: str) -> bool:
    """Whether spec ``name`` declares ``"cuda"`` in its ``REQUIRES``: read from its source where that is one dict
    literal (importing a spec imports the framework's model code: over 6 s for every spec on a 2-core machine, which
    each pytest worker paid while collecting ``tests/examples/test_real_model_gpu_specs.py``), imported otherwise."""
    declared = _declared_requirements(name)
    if declared is not None:
        return "cuda" in declared
    return "cuda" in getattr(importlib.import_module(f"{PACKAGE}.{name}"), "REQUIRES", {})
