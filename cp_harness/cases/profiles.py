"""Hypothesis profiles: ``ci`` (default), ``nightly`` and ``dev``.

- ``ci``: 100 examples per unit, derandomised (the same cases on every run, so
  a pull request's result depends on its commit alone), no example database;
  CP sizes above 4 are drawn half as often as the others
  (``strategies.CaseSpace(favour_small=True)``: an 8-rank case costs 5-7 times a
  2-rank one on 2 cores).
- ``nightly``: ten times the examples, random, database written.
- ``dev``: 20 examples per unit, random, database written (quick iterations
  that replay what failed last).

The pytest plugin registers them and, when a run is about CP (``--cp-impl``,
``$CP_IMPL``, an argument naming ``cp_harness``, or this checkout), makes
``ci`` the default unless ``--hypothesis-profile`` chose one; other projects'
tests in the same environment keep their own Hypothesis settings.

Tests size themselves with ``examples(fraction)``: a fraction of the active
profile's ``max_examples``, so one switch (``--hypothesis-profile nightly``)
scales every property together.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.function_scoped_fixture, HealthCheck.large_base_example]

_registered = False


def register(load_default: bool = False) -> None:
    """Register the three profiles (idempotent); ``load_default``: also make ``ci`` the active profile."""
    global _registered
    if _registered:
        return
    common = dict(deadline=None, suppress_health_check=_SUPPRESS, print_blob=True)
    # ci: the same examples on every run, nothing written to an example database.
    settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **common)
    settings.register_profile("nightly", max_examples=1000, derandomize=False, **common)
    settings.register_profile("dev", max_examples=20, derandomize=False,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink], **common)
    _registered = True
    if load_default:
        settings.load_profile("ci")


def examples(fraction: float) -> int:
    """``fraction`` of the active profile's ``max_examples`` (at least 1)."""
    return max(1, int(round(settings.default.max_examples * fraction)))
