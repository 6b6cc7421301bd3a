"""Attention subjects: the framework's own CP attention functions, each called as its training code calls it, for
the ``cp_attention`` check (``cp_harness/checks/cp_attention.py``: every rank's output and dQ/dK/dV against float64
attention on one device; docs/real_clients.md, "The EAGLE-3 CP attention").

A subject module declares ``NAME`` (its own module name), ``FRAMEWORK_FUNCTION`` (the dotted framework callable),
``STANDINS`` (kernel stand-ins it needs on a CPU), ``WORLD_SIZES``, ``DTYPES``, ``PACKED`` (whether the call takes
packed-document boundaries), and the functions ``seq_multiple(cp_size)``, ``local_positions(seq_len, cp_size,
cp_rank)`` (the framework's sharding of the sequence for it) and ``attention(q, cache_k, cache_v, group, scale,
cu_seqlens)``. ``SUBJECTS``: the modules of this folder, in name order (``scripts/real_clients`` gates each as
``attention:<name>``).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = __name__
SUBJECTS: tuple[str, ...] = tuple(
    sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_"))
)
