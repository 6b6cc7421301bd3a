"""The warm rank pools of one gate run (``tools/run.py``): one per kind of subject and size, each started on first use,
shared by every subject of its kind and size, closed at the end.

Each subject used to run ``python -m cp_harness verify`` in a process of its own: 34 processes on a full run, each
importing torch, hypothesis and the framework, then starting a pool whose launcher imported them again
(``docs/benchmarks.md``). Now every subject runs ``run_verify`` in the gate's process, on one of these pools:

- ``("impls", n)``: the adapters and the attention subjects whose largest CP size is ``n``; the launcher imports
  ``cp_impl`` and every adapter of the run once before it forks, so a start after a rank raised (most documented
  adapter defects fail that way) forks ranks that hold them instead of ranks that each import the framework;
- ``("models", n)``: the model specs whose largest CP size is ``n``, every one of them preloaded (their kernel
  stand-ins are entered around each case, not installed for the process: ``cp_harness.standins``);
- ``("training", 4)``: the training-step subjects (the framework's mesh covers the whole default group; FSDP2 wraps
  the model it builds, so these ranks keep no model another subject's case could reuse).

A pool has the size the subject's own ``verify`` would have started: what a row draws and which explicit cases fit
depend on it (``CaseSpace.pool_size``), so the verdicts are those of the separate processes.
"""

from __future__ import annotations

from collections.abc import Iterable

from cp_harness.ranks.pool import PoolConfig, RankPool

MODEL_CASE_TIMEOUT = 300.0  # verify's rule (VerifySettings.resolved_case_timeout): a rank's first case builds the model
CASE_TIMEOUT = 120.0

Key = tuple[str, int]


class GatePools:
    """The pools of one run, by ``Key``; ``given``: a warm pool the caller owns, used for every ``"impls"`` subject
    (the default command's test of the gate runs the adapters on the session's pool)."""

    def __init__(self, backend: str, given: RankPool | None = None) -> None:
        self.backend = backend
        self.given = given
        self._wanted: dict[Key, set[str]] = {}
        self._pools: dict[Key, RankPool] = {}

    def plan(self, key: Key, modules: Iterable[str]) -> None:
        """Say, before any pool starts, that a subject of ``key`` needs ``modules`` (adapters or model specs)."""
        self._wanted.setdefault(key, set()).update(modules)

    def pool(self, key: Key) -> RankPool:
        """The pool for ``key``, started here on first use."""
        kind, ranks = key
        if kind == "impls" and self.given is not None:
            return self.given
        if key not in self._pools:
            modules = tuple(sorted(self._wanted.get(key, ())))
            timeout = CASE_TIMEOUT if kind == "impls" else MODEL_CASE_TIMEOUT
            config = PoolConfig(
                world_size=ranks,
                backend=self.backend,
                impl=",".join(["cp_impl", *modules]) if kind == "impls" else "cp_impl",
                preload=() if kind == "impls" else modules,
                case_timeout=timeout,
                collective_timeout=max(30.0, timeout / 2),
            )
            pool = RankPool(config)
            pool.start()
            self._pools[key] = pool
        return self._pools[key]

    def warm(self, key: Key) -> RankPool | None:
        """The pool ``key`` names if it is up (the caller's for ``"impls"``), else ``None``: starts nothing."""
        return self.given if key[0] == "impls" and self.given is not None else self._pools.get(key)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
