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


def needs_cuda(name: str) -> bool:
    """Whether spec ``name`` declares ``"cuda"`` in its ``REQUIRES`` (imports the spec)."""
    return "cuda" in getattr(importlib.import_module(f"{PACKAGE}.{name}"), "REQUIRES", {})
