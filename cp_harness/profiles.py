"""Hypothesis profiles: ``ci`` (default), ``nightly`` and ``dev``.

Tests size themselves with ``examples(fraction)``: a fraction of the active
profile's ``max_examples``, so one switch (``--hypothesis-profile nightly``)
scales every property together.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.function_scoped_fixture, HealthCheck.large_base_example]

_registered = False


def register() -> None:
    """Register the three profiles and make ``ci`` the default (idempotent)."""
    global _registered
    if _registered:
        return
    common = dict(deadline=None, suppress_health_check=_SUPPRESS, print_blob=True)
    # ci: the same examples on every run, nothing written to an example database.
    settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **common)
    settings.register_profile("nightly", max_examples=1000, derandomize=False, **common)
    settings.register_profile("dev", max_examples=20, derandomize=False,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink], **common)
    settings.load_profile("ci")
    _registered = True


def examples(fraction: float) -> int:
    """``fraction`` of the active profile's ``max_examples`` (at least 1)."""
    return max(1, int(round(settings.default.max_examples * fraction)))
