"""Shared by the real-model test modules of this folder (imported by name: pytest puts this folder on ``sys.path``
for its test modules): how a ``real_model`` case is written and which quantities a report compared."""

from __future__ import annotations


def real_model_case(spec: str, dtype: str, world_size: int, **batch) -> dict:
    """A ``real_model`` case of ``spec`` (dotted module) in ``dtype`` at CP ``world_size``, seed 0, batch keys
    ``batch`` (``kind``, ``seq_len``, ...), as the verify rows draw them."""
    return {"check": "real_model", "spec": spec, "dtype": dtype, "seed": 0, "world_size": world_size,
            "batch": batch}


def comparison_kinds(report) -> set[str]:
    """The kinds of quantity ``report`` compared: ``"logits"``, ``"loss"``, ``"grad"`` (a comparison's name up to
    its first space or parenthesis)."""
    return {c.name.split(" (")[0].split(" ")[0] for c in report.comparisons}
