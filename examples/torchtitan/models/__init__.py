"""Model specs of torchtitan 0.3.0's CP path (the contract: ``cp_harness/usage/spec_contract.py``; the page:
docs/torchtitan.md). ``SPECS`` is found by reading this folder, as ``examples.automodel.models.SPECS`` is: each module
assigning ``NAME = "<its module name>"`` at top level is a spec (``_llama3`` holds what they share)."""

from __future__ import annotations

from pathlib import Path

from examples.automodel.models import _declares_own_name

PACKAGE = __name__

SPECS: tuple[str, ...] = tuple(
    sorted(
        path.stem
        for path in Path(__file__).parent.glob("*.py")
        if not path.stem.startswith("_") and _declares_own_name(path)
    )
)
