"""Overlap and pipelining: the oracle computed while the ranks work, several cases in flight.

- ``CaseRunner.run_many`` (cases ``k+1..`` queued on the ranks while case ``k``
  is judged) gives the very reports that ``CaseRunner.run`` gives one by one,
  for a mixed list of checks and world sizes, and the same counters;
- ``checks.expect`` computed before the outputs are collected gives the same
  report as ``checks.evaluate`` computing it afterwards;
- ``RankPool.submit``/``collect``: outputs come back to the right ticket, in
  any collection order;
- a rank fault in the middle of a pipeline fails its own case, naming its rank
  and its case, and every case queued behind it still gets a correct verdict
  (it is sent again to the fresh pool). That test needs faults, so it has a
  small pool of its own; the others share the session's ``cp_runner``.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from cp_harness import checks
from cp_harness.cases.descriptions import canonical
from cp_harness.ranks.outputs import RankFailureKind
from cp_harness.ranks.pool import PoolConfig, RankFailure
from cp_harness.runner import CaseRunner
from cp_harness.judging.render import problem_text, report_text
from cp_harness.judging.verdicts import ProblemKind

LAYOUT = {"format": "thd", "seq_len": 12, "docs": [[[5, 6], [4, 6]]]}


def mixed_cases(max_world: int) -> list[dict]:
    """Cases of several checks and world sizes (those the pool can run), arithmetic ones included."""
    cases = [
        {"check": "model", "world_size": 2, "seed": 3, "model": "inkling2", "dtype": "float64", "num_chunks": 1,
         "batch": {"format": "thd", "seq_len": 16, "docs": [[[6, 8], [5, 8]], [[10, 12], [3, 4]]]}},
        {"check": "shifted_cp_loss", "world_size": 2, "seed": 4, "model": "mistral_large4", "dtype": "float32",
         "vocab": 9, "batch": LAYOUT},
        {"check": "gather_sequence", "world_size": 3, "seed": 5, "dtype": "float32", "shape": [2, 3, 4]},
        {"check": "pool_selftest", "world_size": 1, "seed": 0, "mode": "ok"},
        {"check": "convolution_history", "world_size": 4, "seed": 6, "dtype": "float64", "shape": [1, 3, 2],
         "width": 5},
        {"check": "shifted_cp_loss", "world_size": 3, "seed": 7, "model": "mistral_large4", "dtype": "bfloat16",
         "vocab": 7, "batch": LAYOUT},
        {"check": "gather_tokens", "world_size": 2, "seed": 8, "dtype": "float64", "shape": [4, 3]},
        {"check": "model", "world_size": 1, "seed": 9, "model": "mistral_large4", "dtype": "float32",
         "num_chunks": 1, "batch": {"format": "thd", "seq_len": 16, "docs": [[[7, 8], [6, 8]]]}},
        {"check": "pool_selftest", "world_size": 2, "seed": 1, "mode": "ok"},
        {"check": "mistral_large4_layout", "world_size": 2, "seed": 9, "model": "mistral_large4", "num_chunks": 1,
         "shard_primary": True, "batch": {"format": "thd", "seq_len": 9, "docs": [[[2, 3], [5, 5]]]}},
        {"check": "inkling2_layout", "world_size": 3, "seed": 7, "model": "inkling2", "num_chunks": 1,
         "batch": {"format": "thd", "seq_len": 10, "docs": [[[1, 1], [0, 2], [4, 5]]], "eos_is_pad": True}},
    ]
    return [c for c in cases if c["world_size"] <= max_world]


def signature(report) -> tuple:
    """Everything a verdict consists of (not the timings)."""
    return (report.ok, tuple(report.problems), tuple(repr(c) for c in report.comparisons),
            tuple((getattr(c, 'max_ulp', None), getattr(c, 'excess', None)) for c in report.comparisons),
            repr(report.info), repr(report.comm), tuple(sorted(report.called)), report_text(report))


def counters(runner) -> tuple:
    t = runner.tally
    return (dict(t.by_size), dict(t.by_check), dict(t.by_dtype), dict(t.by_impl), t.baseline_runs, t.failures)


def delta(after: tuple, before: tuple) -> tuple:
    out = []
    for a, b in zip(after, before):
        out.append({k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)} if isinstance(a, dict) else a - b)
    return tuple(out)


def test_pipelined_reports_equal_sequential_ones(cp_runner):
    cases = mixed_cases(cp_runner.config.world_size)
    assert len({c["check"] for c in cases}) >= 4 and len({c["world_size"] for c in cases}) >= 2

    cp_runner.baselines.reports.clear()  # both passes run their one-rank baselines (the cache is only a cache)
    before = counters(cp_runner)
    sequential = [cp_runner.run(case) for case in cases]
    seq_counts = delta(counters(cp_runner), before)

    cp_runner.baselines.reports.clear()
    before = counters(cp_runner)
    pipelined = list(cp_runner.run_many(cases))
    pipe_counts = delta(counters(cp_runner), before)

    assert [r.case for r in pipelined] == cases
    for case, seq, pipe in zip(cases, sequential, pipelined):
        assert seq.ok, f"{canonical(case)}:\n{report_text(seq)}"
        assert signature(pipe) == signature(seq), canonical(case)
    assert pipe_counts == seq_counts
    assert seq_counts[4] >= 2  # the one-rank baselines of the arithmetic cases ran (and were counted) in both
    assert all(set(r.timing) >= {"ranks", "transport", "oracle", "compare"} for r in pipelined)


def test_expect_before_collect_equals_evaluate_after(cp_runner):
    pool = cp_runner.pool
    for case in mixed_cases(cp_runner.config.world_size)[:3]:
        ticket = pool.submit(case)
        expected = checks.expect(case)  # while the ranks work
        outputs = pool.collect(ticket)
        early = checks.evaluate(case, outputs, expected)
        late = checks.evaluate(case, outputs)  # computes expect itself, as every existing caller does
        assert early.ok, report_text(early)
        assert signature(early) == signature(late), canonical(case)
        if checks.get_check(case["check"]).expect is not None:
            assert report_text(checks.evaluate(case, outputs, expected)) == report_text(early)  # expected is not consumed


def test_tickets_collected_in_any_order(cp_runner):
    pool = cp_runner.pool
    n = min(cp_runner.config.world_size, 3)
    cases = [{"check": "pool_selftest", "world_size": w, "seed": i, "mode": "ok"}
             for i, w in enumerate([n, 1, n, 2 if n >= 2 else 1, n])]
    tickets = [pool.submit(case) for case in cases]
    assert pool.in_flight >= 1
    order = [3, 0, 4, 1, 2]
    got = {i: pool.collect(tickets[i]) for i in order}
    for i, case in enumerate(cases):
        outputs = got[i]
        assert [o.rank for o in outputs] == list(range(case["world_size"]))
        assert checks.evaluate(case, outputs).ok
        assert tickets[i].timing["ranks"] >= 0 and tickets[i].timing["transport"] >= 0
    assert pool.in_flight == 0


# ------------------------------------------------------------------ a fault in the middle of a pipeline
WORLD = 2


@pytest.fixture(scope="module")
def fault_runner(tmp_path_factory):
    # The pool's default timeouts (60 s a case, 30 s a collective): no fault here needs one to fire (a raise ends
    # its case after the pool's grace for the peers, an exit when the connection closes), and the healthy cases,
    # models among them, must not time out on a busy machine.
    runner = CaseRunner(PoolConfig(world_size=WORLD, log_dir=str(tmp_path_factory.mktemp("overlap-pool"))))
    try:
        yield runner
    finally:
        runner.close()


def test_fault_in_a_pipeline_fails_only_its_own_case(fault_runner):
    healthy = mixed_cases(WORLD)
    raise_case = {"check": "pool_selftest", "world_size": 2, "seed": 11, "mode": "raise", "fault_rank": 1}
    exit_case = {"check": "pool_selftest", "world_size": 2, "seed": 12, "mode": "exit", "fault_rank": 0}
    cases = healthy[:2] + [raise_case] + healthy[2:4] + [exit_case] + healthy[4:]
    faults = {canonical(raise_case): (1, "raised", "injected fault on rank 1"),
              canonical(exit_case): (0, "exited", "exited while running the case")}

    starts = fault_runner.pool.starts
    reports = list(fault_runner.run_many(cases))
    assert [r.case for r in reports] == cases
    assert fault_runner.pool.starts >= starts + 2  # each fault tore its pool down

    # The healthy cases, one by one on a healthy pool: the pipelined verdicts must be these.
    fault_runner.baselines.reports.clear()
    sequential = {canonical(c): fault_runner.run(c) for c in healthy}
    for case, report in zip(cases, reports):
        key = canonical(case)
        if key in faults:
            rank, kind, what = faults[key]
            assert not report.ok
            assert len(report.problems) == 1, report.problems
            problem = report.problems[0]
            assert problem.rank == rank and problem.kind is ProblemKind.of_rank_failure(kind), problem
            text = problem_text(problem)
            assert text.startswith(f"rank {rank} {kind}:"), text
            assert what in text and f"case: {case}" in text, text
        else:
            assert report.ok, f"{key}:\n{report_text(report)}"
            assert signature(report) == signature(sequential[key]), key
    assert fault_runner.tally.failures == 2


def test_fault_at_submit_time_is_not_blamed_on_the_next_case(fault_runner):
    """A rank that died while a case was in flight: the cases submitted after it run on the fresh pool."""
    pool = fault_runner.pool
    ok = [{"check": "pool_selftest", "world_size": 2, "seed": s, "mode": "ok"} for s in range(3)]
    exit_case = {"check": "pool_selftest", "world_size": 2, "seed": 13, "mode": "exit", "fault_rank": 1}
    pool.start()
    # The launcher is stopped until the next cases are sent: it cannot reap the dead rank, end the others or exit,
    # so the pool still looks alive and they are sent to the broken pool (the sends may then fail), whatever the load.
    launcher = pool.launcher_pid
    os.kill(launcher, signal.SIGSTOP)
    try:
        first = pool.submit(exit_case)
        pid = pool.pids[1]
        for _ in range(1200):  # at most 60 s: the rank exits as soon as it reads the case
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, its stopped launcher not reaping it
                    break
            time.sleep(0.05)
        else:
            pytest.fail(f"rank 1 (pid {pid}) still runs 60 s after it was sent a case that makes it exit")
        tickets = [pool.submit(c) for c in ok]
    finally:
        os.kill(launcher, signal.SIGCONT)
    with pytest.raises(RankFailure) as failure:
        pool.collect(first)
    assert failure.value.rank == 1 and failure.value.kind is RankFailureKind.EXITED
    assert failure.value.case == exit_case
    for case, ticket in zip(ok, tickets):
        outputs = pool.collect(ticket)
        assert checks.evaluate(case, outputs).ok
        assert ticket.sends == 2  # sent to the broken pool, then again to the fresh one
        assert np.array_equal(outputs[0].tensors["sum"], np.array([1.0], dtype=np.float32))
