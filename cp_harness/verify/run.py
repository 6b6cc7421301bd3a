"""``run_verify``: start (or borrow) a pool, run every selected row, return the ``VerifyResult``. Nothing here
prints the result; the command does (``cp_harness.__main__``)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from cp_harness.cases.implementation import impl_names, primary_impl
from cp_harness.cases.profiles import FLOAT_DTYPES, VALUE_DTYPES, CaseSpace
from cp_harness.judging.error_maps import error_map_dir
from cp_harness.ranks.pool import PoolConfig, RankPool
from cp_harness.runner import CaseRunner
from cp_harness.verify.progress import Progress
from cp_harness.verify.result import VerifyResult, VerifySettings
from cp_harness.verify.rows import Row, default_rows, select_rows
from cp_harness.verify.search import run_row


def _naming_impl(row: Row, impl: str) -> Row:
    """``row`` whose cases name ``impl`` (its primary module unless a case drew another): on a shared pool the
    ranks' default implementation is the pool's, not this run's."""
    primary = primary_impl(impl)

    def name(case: dict) -> dict:
        return case if "impl" in case else {**case, "impl": primary}

    spec = row.spec
    return dataclasses.replace(
        row,
        spec=dataclasses.replace(
            spec, cases=lambda space: spec.cases(space).map(name), explicit=tuple(name(c) for c in spec.explicit)
        ),
    )


def _preflight(impl: str, backend: str, world_size: int) -> str | None:
    """Why the run cannot start (``None`` when it can): the implementation must import, the devices must fit."""
    from cp_harness.cases.implementation import load_impl
    from cp_harness.ranks.devices import DeviceError, check_backend

    try:
        check_backend(backend, world_size)
        names = impl_names(impl)
    except (DeviceError, ValueError) as exc:
        return str(exc)
    for name in names:
        try:
            load_impl(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported as such
            return (
                f"implementation {name!r} does not import here: {type(exc).__name__}: {exc}\n"
                f"(is it installed, or on PYTHONPATH? sys.path[0] is {sys.path[0]!r})"
            )
    return None


def _preflight_models(models: tuple[str, ...]) -> str | None:
    """Why the model specs cannot be used (``None`` when they can): each imports and meets the spec contract."""
    from cp_harness.usage.model_specs import load_spec

    for name in models:
        try:
            load_spec(name)
        except Exception as exc:  # noqa: BLE001 - a missing field, or an import failure, stops the run
            return f"{type(exc).__name__}: {exc}"
    return None


def run_verify(
    settings: VerifySettings, *, rows: list[Row] | None = None, pool: RankPool | None = None, progress_stream=None
) -> VerifyResult:
    """Run every row ``settings`` selects (``rows``: instead of the declared ones) and return what was found.

    ``pool``: run on this warm pool (its ranks load ``settings.impl`` on first use; it needs
    ``max(settings.world_sizes)`` ranks and stays up afterwards) instead of starting one. With
    ``settings.model`` the real-model rows run (``cp_harness.checks.real_model``) instead of the
    implementation's. Progress goes to ``progress_stream`` (default stderr); the result is not printed.
    """
    s = settings
    result = VerifyResult(settings=s, error_map_dir=os.path.abspath(error_map_dir(s.error_dir)))
    chosen = [
        r
        for r in (rows or default_rows())
        if r.spec.needs_model == bool(s.model) and (not s.model or r.spec.step == s.step)
    ]
    chosen = select_rows(chosen, dtypes=s.dtypes, names=s.rows)
    if not chosen:
        result.cannot_run = f"no row matches --dtypes {s.dtypes} / --rows {list(s.rows)}"
        return result
    ranks = max(s.world_sizes)
    if pool is not None and pool.config.world_size < ranks:
        result.cannot_run = (
            f"the given pool has {pool.config.world_size} ranks, world sizes {list(s.world_sizes)} need {ranks}"
        )
        return result
    # Each node gives its own ranks their GPUs (nccl): this machine needs one node's share.
    here = ranks // int(s.pool.get("nnodes", 1)) if s.pool.get("launcher", s.launcher) != "external" else 0
    problem = _preflight(s.impl, s.backend, max(here, 1)) or _preflight_models(s.model)
    if problem:
        result.cannot_run = problem
        return result
    drawn = (
        (tuple(d for d in s.dtypes if d != "layout") or FLOAT_DTYPES)
        if s.dtypes is not None
        else FLOAT_DTYPES + VALUE_DTYPES
    )
    space = CaseSpace(
        world_sizes=tuple(s.world_sizes),
        dtypes=drawn,
        impls=impl_names(s.impl),
        models=s.model,
        pool_size=pool.config.world_size if pool is not None else ranks,
    )
    if pool is None:
        try:
            config = PoolConfig(
                world_size=ranks,
                backend=s.backend,
                impl=s.impl,
                launcher=s.launcher,
                preload=s.model,
                **{**s.pool, "case_timeout": s.resolved_case_timeout},
                collective_timeout=max(30.0, s.resolved_case_timeout / 2),
            )
        except ValueError as exc:  # a node layout that cannot be: nothing started
            result.cannot_run = str(exc)
            return result
        runner = CaseRunner(config, policy=s.policy)
    else:  # the pool's own selection stays; every case names its implementation
        runner = CaseRunner(pool.config, pool=pool, policy=s.policy)
        chosen = [_naming_impl(row, s.impl) for row in chosen]
    result.rows = chosen
    progress = Progress(total=s.examples * len(chosen), stream=progress_stream)
    started = time.perf_counter()
    try:
        config = runner.pool.config
        nodes = f" on {config.nnodes} nodes" if config.nnodes > 1 else ""
        progress.note(
            f"cp_harness verify: starting {ranks} ranks ({s.backend}){nodes} for implementation {s.impl!r} ..."
        )
        try:
            for node, command in runner.pool.remote_commands().items():
                progress.note(f"cp_harness verify: start node {node} with: {command}")
            runner.pool.start()
        except Exception as exc:  # noqa: BLE001
            result.cannot_run = f"the rank pool did not start: {exc}"
            return result
        progress.note(
            f"cp_harness verify: pool up in {time.perf_counter() - started:.1f} s; "
            f"{s.examples} examples per row, {len(chosen)} rows"
        )
        for row in chosen:
            skip = row.spec.skip(space) if row.spec.skip is not None else None
            if skip is not None:
                row.tally.skipped = skip
                progress.note(f"cp_harness verify: skipped {row.name}: {skip}")
                continue
            run_row(
                row,
                runner,
                space,
                s.examples,
                s.seed,
                progress,
                s.backend,
                result.error_map_dir,
                s.shrink_seconds,
                s.export_repros,
                s.known_failure,
            )
    finally:
        progress.finish()
        runner.close()
    result.seconds = time.perf_counter() - started
    result.examples_per_world_size = dict(runner.tally.by_size)
    result.baseline_runs = runner.tally.baseline_runs
    return result
