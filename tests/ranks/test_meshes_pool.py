"""The pool on world meshes (``cp_harness.cases.meshes``): every rank of every CP group gets the right
``world_mesh["cp"]``, CP groups of one mesh run different cases at once, a collective that leaves the CP group is
refused by the meter at once (not left to hang), and a layout that cannot be built is refused before anything is
sent. All on the session's warm ranks."""

from __future__ import annotations

import time

import pytest

from cp_harness.cases import meshes
from cp_harness.checks.meshes import MESH_IDENTITY
from cp_harness.checks.pool_selftest import POOL_SELFTEST

LAYOUTS = [
    {"dims": ["dp", "cp"], "shape": [2, 2]},                      # CP inner: {0, 1}, {2, 3}
    {"dims": ["cp", "dp"], "shape": [2, 2]},                      # CP outer: {0, 2}, {1, 3}
    {"dims": ["dp_shard", "cp", "tp"], "shape": [2, 2, 1], "ranks": [1, 3, 5, 7]},  # {1, 3}, {5, 7}
    {"dims": ["dp", "cp"], "shape": [1, 4], "ranks": [4, 5, 6, 7]},  # one group that is not 0..3
    {"dims": ["pp", "cp", "dp"], "shape": [2, 2, 2]},             # the whole pool: four CP groups of two
    {"dims": ["dp", "cp"], "shape": [8, 1]},                      # eight CP groups of one rank
    {"dims": ["cp", "tp"], "shape": [8, 1]},                      # CP over the whole pool, tp = 1
]


def _need(cp_runner, layout):
    if meshes.MeshLayout.parse(layout).ranks[-1] >= cp_runner.config.world_size:
        pytest.skip(f"needs a pool of {meshes.MeshLayout.parse(layout).ranks[-1] + 1} ranks (--cp-world-sizes)")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[meshes.MeshLayout.parse(x).label() for x in LAYOUTS])
def test_every_rank_gets_the_cp_mesh_of_its_group(cp_runner, layout):
    _need(cp_runner, layout)
    n = meshes.MeshLayout.parse(layout).cp_size
    cp_runner.check(MESH_IDENTITY.case(world_size=n, seed=0, **{meshes.KEY: layout}))


def test_cp_groups_of_one_mesh_run_different_cases_at_once(cp_runner, tmp_path):
    """Group 0's case waits on one rank until group 1's case, sent after it, has run its collective: were the
    groups run one after the other, group 1's case could not run before group 0's had waited out its 60 s."""
    _need(cp_runner, {"dims": ["dp", "cp"], "shape": [2, 2]})
    layout = {"dims": ["dp", "cp"], "shape": [2, 2]}
    release = tmp_path / "release"
    slow = POOL_SELFTEST.case(world_size=2, seed=0, mode="hang", fault_rank=0, hang_seconds=60.0,
                              hang_until=str(release), **{meshes.KEY: {**layout, "run": [0]}})
    quick = POOL_SELFTEST.case(world_size=2, seed=1, mode="ok", done_file=str(release),
                               **{meshes.KEY: {**layout, "run": [1]}})
    pool = cp_runner.pool
    first, second = pool.submit(slow, timeout=120), pool.submit(quick, timeout=120)
    a, b = pool.collect(first), pool.collect(second)
    assert [o.rank for o in a] == [0, 1] and [o.rank for o in b] == [2, 3]
    assert [(o.group, o.cp_rank) for o in b] == [(1, 0), (1, 1)]
    assert all(o.ok for o in a + b), [o.message for o in a + b]
    assert a[0].info["released"], "group 0's rank waited out its hang: group 1's case did not run beside it"
    assert min(o.started_at for o in b) < min(o.finished_at for o in a)


def test_a_collective_outside_the_cp_group_is_refused_at_once(cp_runner):
    _need(cp_runner, {"dims": ["dp", "cp"], "shape": [2, 2]})
    runner = cp_runner.sharing_pool()
    case = POOL_SELFTEST.case(world_size=2, seed=0, mode="leak", **{meshes.KEY: {"dims": ["dp", "cp"],
                                                                                  "shape": [2, 2]}})
    started = time.monotonic()
    report = runner.run(case, timeout=60)
    elapsed = time.monotonic() - started
    text = "\n".join(p.message + p.detail for p in report.problems)
    assert not report.ok and "CommLeak" in text, text
    assert "outside this rank's CP group [2, 3]" in text or "outside this rank's CP group [0, 1]" in text, text
    assert f"global ranks {list(range(cp_runner.config.world_size))}" in text, text
    # Refused before it reached the backend: no collective timeout was waited for.
    assert elapsed < cp_runner.config.collective_timeout, f"{elapsed:.1f} s"
    # On a one-dimensional mesh over the whole pool the default group is the CP group: nothing leaks.
    whole = cp_runner.config.world_size
    assert runner.run(POOL_SELFTEST.case(world_size=whole, seed=0, mode="leak")).ok


def test_a_layout_that_cannot_be_built_is_refused_before_anything_is_sent(cp_runner):
    pool = cp_runner.pool
    pool.start()
    starts = pool.starts
    bad = POOL_SELFTEST.case(world_size=2, seed=0, **{meshes.KEY: {"dims": ["dp", "cp"], "shape": [2, 3]}})
    with pytest.raises(ValueError, match=r"mesh_layout.shape\[1\]"):
        pool.submit(bad)
    big = POOL_SELFTEST.case(world_size=2, seed=0, **{meshes.KEY: {"dims": ["dp", "cp"],
                                                                    "shape": [pool.config.world_size, 2]}})
    with pytest.raises(ValueError, match="start a pool of at least"):
        pool.submit(big)
    assert pool.starts == starts and pool.in_flight == 0
