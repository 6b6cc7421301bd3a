"""Profiles, the only configuration of what is drawn: Hypothesis' settings profiles and the case space.

Hypothesis profiles: ``ci`` (default), ``nightly`` and ``dev`` for the test suite; ``verify`` and
``calibrate`` for the commands of the same names (their only per-run setting is the example count).

- ``ci``: 100 examples per unit, derandomised (the same cases on every run, so
  a pull request's result depends on its commit alone), no example database;
  CP sizes above 4 are drawn a quarter as often as each of the others
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

The **case space** (``CaseSpace``: CP sizes, payload dtypes, implementations, model specs) works the same
way: named spaces are registered and one is loaded (``register_space`` / ``load_space``, as
``settings.register_profile`` / ``load_profile``); strategies given no space draw from the loaded one
(``current_space``). The pytest plugin registers and loads the session's once, from its options, before any
test module is imported; ``verify`` and ``calibrate`` pass their own space to every strategy and load none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, Phase, settings

_SUPPRESS = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,
    HealthCheck.large_base_example,
]

DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)

# Floating dtypes (payloads, logits, models) and the integer/bool payloads of data-movement checks.
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
VALUE_DTYPES = ("int64", "bool")
ALL_DTYPES = FLOAT_DTYPES + VALUE_DTYPES + ("int32",)
# The order reports list payload dtypes in (``layout``: the cases without a floating payload).
DTYPE_ORDER = ("float64", "float32", "bfloat16", "float16", "int64", "int32", "bool", "layout")


def in_dtype_order(names) -> list[str]:
    """``names`` (payload dtype names) in ``DTYPE_ORDER``, unknown names last, alphabetically."""
    order = {name: i for i, name in enumerate(DTYPE_ORDER)}
    return sorted(names, key=lambda d: (order.get(d, len(order)), d))


# The ci profile draws CP sizes above this a quarter as often as each of the others: on 2 cores a case of 8 ranks
# costs 5-7 times one of 2 (every collective waits for 8 processes to be scheduled, and about a third of the busy
# CPU of a model test is gloo's socket loop in the kernel), and the 1,2,3,4 cases exercise the same shard
# boundaries; the nightly and dev profiles draw every size equally.
CI_FULL_WEIGHT_MAX_SIZE = 4
CI_SMALL_SIZE_WEIGHT = 4  # how many times each size up to CI_FULL_WEIGHT_MAX_SIZE is listed in the draws


@dataclasses.dataclass(frozen=True)
class CaseSpace:
    """Where cases are drawn from: CP sizes, payload dtypes, implementations.

    ``favour_small`` (the ci profile): sizes up to ``CI_FULL_WEIGHT_MAX_SIZE`` are drawn ``CI_SMALL_SIZE_WEIGHT``
    times as often as larger ones (every size is still drawn; shrinking still goes towards the first).
    ``impls``: with more than one, every case that goes through a sharder draws one into its ``"impl"`` key.
    """

    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    dtypes: tuple[str, ...] = FLOAT_DTYPES + VALUE_DTYPES
    impls: tuple[str, ...] = ()
    favour_small: bool = False
    models: tuple[str, ...] = ()  # model spec modules the real-model rows draw (``--model`` / ``--cp-model``)
    # The ranks of the pool the cases run on (None: the largest CP size); a world mesh
    # (``cp_harness.cases.meshes``) is drawn to fit it.
    pool_size: int | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.dtypes) - set(ALL_DTYPES))
        if unknown or not self.dtypes:
            raise ValueError(f"dtypes {unknown or list(self.dtypes)}: choose among {list(ALL_DTYPES)}")
        if not self.world_sizes or any(int(n) < 1 for n in self.world_sizes):
            raise ValueError(f"world sizes {list(self.world_sizes)}: give positive CP sizes")

    @property
    def pool_ranks(self) -> int:
        """The ranks of the pool the space's cases run on."""
        return self.pool_size if self.pool_size is not None else max(self.world_sizes)

    @property
    def size_draws(self) -> tuple[int, ...]:
        """The sizes as drawn: a size listed twice is drawn twice as often."""
        if self.favour_small and any(n <= CI_FULL_WEIGHT_MAX_SIZE for n in self.world_sizes):
            return tuple(
                n for n in self.world_sizes for _ in range(CI_SMALL_SIZE_WEIGHT if n <= CI_FULL_WEIGHT_MAX_SIZE else 1)
            )
        return tuple(self.world_sizes)


_registered = False


def register(load_default: bool = False) -> None:
    """Register the three profiles (idempotent); ``load_default``: also make ``ci`` the active profile."""
    global _registered
    if _registered:
        return
    common: dict[str, Any] = dict(deadline=None, suppress_health_check=_SUPPRESS, print_blob=True)
    # ci: the same examples on every run, nothing written to an example database.
    settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **common)
    settings.register_profile("nightly", max_examples=1000, derandomize=False, **common)
    settings.register_profile(
        "dev",
        max_examples=20,
        derandomize=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        **common,
    )
    # The commands: seeded by @seed (the same cases for the same seed), no database, nothing reported but the
    # shrunk failure; verify shrinks (its own time budget stops it), calibrate only generates.
    command: dict[str, Any] = dict(
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    settings.register_profile("verify", phases=[Phase.explicit, Phase.generate, Phase.shrink], **command)
    settings.register_profile("calibrate", phases=[Phase.generate], **command)
    _registered = True
    if load_default:
        settings.load_profile("ci")


def examples(fraction: float) -> int:
    """``fraction`` of the active profile's ``max_examples`` (at least 1)."""
    active = settings.default
    assert active is not None  # hypothesis always has a profile loaded
    return max(1, int(round(active.max_examples * fraction)))


_SPACES: dict[str, CaseSpace] = {"default": CaseSpace()}
_loaded_space = "default"


def register_space(name: str, space: CaseSpace) -> None:
    """Register a named case space (``load_space`` makes it the one strategies without a space draw from)."""
    if not isinstance(space, CaseSpace):
        raise TypeError(f"register_space({name!r}, ...): give a CaseSpace, not {type(space).__name__}")
    _SPACES[name] = space


def load_space(name: str) -> None:
    """Make the registered space ``name`` the current one."""
    global _loaded_space
    if name not in _SPACES:
        raise KeyError(f"no case space {name!r} registered; registered: {sorted(_SPACES)}")
    _loaded_space = name


def current_space() -> CaseSpace:
    """The loaded case space (``"default"`` until the plugin loads the session's)."""
    return _SPACES[_loaded_space]


def command_settings(name: str, examples: int) -> settings:
    """The settings of command profile ``name`` (``"verify"``, ``"calibrate"``) with ``examples`` examples."""
    register()
    return settings(settings.get_profile(name), max_examples=examples)
