"""The gate on world meshes: implementations with the prefix-group bugs fail ``verify``, naming what they got wrong.

Each held-out module (``tests/fixtures/broken_mesh_*``) is the bundled implementation with one bug that no case
on a CP mesh over ranks ``0..N-1`` can see, because there a CP rank is its global rank and the CP group may be
the default group:

- ``broken_mesh_halo_cp_rank``: the halo's point-to-point peers addressed by CP rank (torch refuses the peer, or
  the message goes to another group's rank);
- ``broken_mesh_loss_peer_cp_rank``: the loss's boundary label sent with ``dst=rank - 1`` on the default group
  (the meter refuses the message: it leaves the CP group);
- ``broken_mesh_rank_from_world``: the CP rank read from ``dist.get_rank()``;
- ``broken_mesh_gather_world``: the gathers on the default group (the meter refuses the collective).

They run on a small pool of their own with a short collective timeout: a rank of a broken module may wait in a
collective for a peer that never comes, and that wait, not the case timeout, is what ends the case (after 3 s, a
hundred times what these collectives of a few elements take on a busy machine, instead of the session's 90 s).
The case timeout (60 s) is only a backstop, so a case slowed by load is never cut short before its bug shows. The bundled
implementation passes the same row in ``test_gate_broken_impls.py::test_verify_passes_on_the_bundled_implementation``.
"""

from __future__ import annotations

import io
import json

import pytest

from cp_harness.ranks.pool import PoolConfig, RankPool
from cp_harness.verify import VerifySettings, run_verify

ROW = 'meshes: gathers, halo, loss on world_mesh["cp"] (2-D/3-D)'
PASSES_ON_PREFIX = "the same case passes on a one-dimensional mesh over ranks"


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    pool = RankPool(PoolConfig(world_size=4, case_timeout=60, collective_timeout=3,
                               log_dir=str(tmp_path_factory.mktemp("mesh-gate"))))
    try:
        yield pool
    finally:
        pool.close()
        pool.cleanup_workdir()


def _verify(impl: str, pool, tmp_path) -> tuple[int, dict]:
    settings = VerifySettings(impl=impl, world_sizes=(2, 3), examples=2, shrink_seconds=0.5, rows=("meshes.functions",),
                              error_dir=str(tmp_path / "error-maps"))
    result = run_verify(settings, pool=pool, progress_stream=io.StringIO())
    assert result.cannot_run is None, result.cannot_run
    report = json.loads(json.dumps(result.as_dict()))
    return result.exit_code, next(r for r in report["rows"] if r["name"] == ROW)


@pytest.mark.parametrize(("impl", "says"), [
    # torch refuses a peer outside the group; the meter refuses a message to the rank itself (which gloo would
    # wait on forever): which comes first depends on the layout.
    ("broken_mesh_halo_cp_rank", (("is not part of group", "a point-to-point message to this rank itself"),
                                  PASSES_ON_PREFIX)),
    ("broken_mesh_loss_peer_cp_rank", ("CommLeak", "a point-to-point message", "leaves this rank's CP group",
                                       PASSES_ON_PREFIX)),
    ("broken_mesh_rank_from_world", (PASSES_ON_PREFIX,)),
    ("broken_mesh_gather_world", ("CommLeak", "on a process group of global ranks [0, 1, 2, 3]",
                                  "outside this rank's CP group")),
])
def test_a_prefix_group_bug_fails_verify_on_world_meshes(small_pool, tmp_path, impl, says):
    code, row = _verify(impl, small_pool, tmp_path)
    assert code == 1 and not row["ok"], row
    case = row["failing_case"]
    assert case["mesh_layout"], case  # it failed on a world mesh ...
    text = row["failure"] + "\n".join(p["message"] + p["detail"] for p in row["problems"])
    for phrase in says:  # ... and the report says how (a tuple: one of these)
        assert any(p in text for p in (phrase if isinstance(phrase, tuple) else (phrase,))), \
            f"{phrase!r} not in:\n{text}"
    assert "of CP group" in text or " on CP group " in text, text  # which CP group (and its global ranks)

