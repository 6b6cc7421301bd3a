"""``ranks.diagnosis.diagnose``: which rank failed a case, and how, from plain data (no processes).

``tests/ranks/test_pool_faults.py`` drives the same diagnosis through real faulting
ranks; here each kind of failure is built from the evidence the pool would have
gathered (replies, a closed connection, the launcher's exit lines and log,
stack dumps), so that every branch, and the wording a newcomer reads, is pinned
in milliseconds.
"""

from __future__ import annotations

from cp_harness.ranks.diagnosis import (
    blocked_in_collectives,
    collective_wait,
    diagnose,
    exit_line,
    exits_in_log,
    format_stacks,
)
from cp_harness.ranks.outputs import OffProtocol, RankFailure, RankFailureKind, RankOutput, decode_reply

CASE = {"check": "pool_selftest", "world_size": 3, "seed": 0, "mode": "x", "fault_rank": 1}
TIMEOUT = 4.0


def ok(rank: int, seconds: float = 0.1) -> RankOutput:
    return RankOutput(rank=rank, ok=True, info={}, tensors={}, comm=[], seconds=seconds)


def raised(rank: int, error_type: str, message: str, seconds: float = 0.1) -> RankOutput:
    return RankOutput(rank=rank, ok=False, info={}, tensors={}, comm=[], seconds=seconds, error_type=error_type,
                      message=message, traceback=f"Traceback (most recent call last):\n  on rank {rank}\n"
                                                 f"{error_type}: {message}\n")


def test_every_rank_answered_is_no_failure():
    assert diagnose(CASE, timeout=TIMEOUT, replies={r: ok(r) for r in range(3)}) is None


def test_a_rank_that_raised_is_named_with_its_traceback_and_its_waiting_peers():
    # Rank 1 raised first; rank 2 gave up waiting for it in a collective (later, and a timeout).
    replies = {0: ok(0), 2: raised(2, "RuntimeError", "Gloo timed out waiting for rank 1", seconds=2.0),
               1: raised(1, "ValueError", "injected fault on rank 1", seconds=0.01)}
    failure = diagnose(CASE, timeout=TIMEOUT, replies=replies)
    assert isinstance(failure, RankFailure) and isinstance(failure, AssertionError)
    assert (failure.rank, failure.kind, failure.case) == (1, RankFailureKind.RAISED, CASE)
    message = str(failure)
    assert message.startswith("rank 1 raised ValueError: injected fault on rank 1\n"), message
    assert "ranks [2] then failed waiting for it." in message
    assert "--- traceback of rank 1 ---\nTraceback (most recent call last):\n  on rank 1" in message
    assert "on rank 2" not in message  # the follower's traceback would point away from the cause
    assert message.endswith(f"\ncase: {CASE}")
    assert failure.outputs == list(replies.values())


def test_a_rank_that_raised_while_others_stay_stuck_shows_their_stacks():
    replies = {1: raised(1, "ValueError", "injected fault on rank 1")}
    failure = diagnose(CASE, timeout=TIMEOUT, replies=replies, unanswered=[2, 0],
                       stacks={0: "Thread 0x1:\n  File \"pool_selftest.py\", line 30 in run\n", 2: "  File \"c.py\"\n"})
    message = str(failure)
    assert (failure.rank, failure.kind) == (1, RankFailureKind.RAISED)
    assert "ranks [0, 2] then did not answer (waiting in a collective for it)." in message
    assert message.index("--- stack of rank 0 ---") < message.index("--- stack of rank 2 ---")
    assert "pool_selftest.py" in message


def test_only_timeouts_name_the_fastest_failure():
    replies = {r: raised(r, "RuntimeError", "connection reset by peer", seconds=1.0 + r) for r in range(3)}
    failure = diagnose(CASE, timeout=TIMEOUT, replies=replies)
    assert (failure.rank, failure.kind) == (0, RankFailureKind.RAISED)
    assert str(failure).startswith("rank 0 raised RuntimeError: connection reset by peer\nTraceback")


def test_the_rank_that_exited_first_is_named_not_the_ones_the_launcher_killed():
    # Rank 2 exited with 17; the fork launcher then ended ranks 0 and 1 with SIGKILL, whose connection
    # closed first here. The launcher's log says who went first, with rank 2's own traceback before it.
    log = ("Traceback (most recent call last):\n  File \"pool_selftest.py\", line 28, in run\n"
           "RuntimeError: rank 2 gave up\n"
           + exit_line(2, 4242, 17, [0, 1]) + "\n"
           + exit_line(0, 4240, -9, [1]) + "\n"
           + exit_line(1, 4241, -9, []) + "\n")
    exits = exits_in_log(log)
    assert exits == [(2, 17), (0, -9), (1, -9)]
    failure = diagnose(CASE, timeout=TIMEOUT, replies={}, closed=(0, "connection closed by peer after 0 of 8 bytes"),
                       launcher_exit=1, exits=exits, log=log)
    assert (failure.rank, failure.kind) == (2, RankFailureKind.EXITED)
    message = str(failure)
    assert message.startswith("rank 2 exited while running the case (connection closed by peer after 0 of 8 bytes; "
                              "rank 0's connection closed when the launcher ended it; fork exit code 1).\n"), message
    assert "fork log tail:\n" + log in message
    assert "RuntimeError: rank 2 gave up" in message


def test_a_rank_that_replied_before_exiting_shows_its_own_traceback():
    # SystemExit inside the case: the rank replied (with its traceback), then exited; the launcher killed the rest.
    replies = {0: ok(0), 2: raised(2, "SystemExit", "3")}
    failure = diagnose(CASE, timeout=TIMEOUT, replies=replies, closed=(1, "connection closed by peer"),
                       launcher_exit=1, exits=[(2, 3), (1, -9)], log="...")
    assert (failure.rank, failure.kind) == (2, RankFailureKind.EXITED)
    message = str(failure)
    assert "--- traceback of rank 2 ---\nTraceback (most recent call last):\n  on rank 2\nSystemExit: 3" in message
    assert failure.outputs == list(replies.values())


def test_without_exit_lines_the_closed_connection_names_the_rank():
    failure = diagnose(CASE, timeout=TIMEOUT, replies={}, closed=(1, "connection closed by peer"),
                       launcher="torchrun", launcher_exit=1, log="torchrun says: rank 1 failed")
    assert (failure.rank, failure.kind) == (1, RankFailureKind.EXITED)
    message = str(failure)
    assert "; rank 1's connection" not in message and "torchrun exit code 1" in message
    assert "torchrun log tail:\ntorchrun says: rank 1 failed" in message


def test_a_hang_names_the_stuck_rank_and_its_stack():
    stack = "\n".join(f"  frame {i}" for i in range(40)) + "\n  File \"pool_selftest.py\", line 33 in run\n"
    replies = {1: raised(1, "RuntimeError", "Gloo timed out", seconds=2.0),
               2: raised(2, "RuntimeError", "Gloo timed out", seconds=2.1)}
    failure = diagnose(CASE, timeout=TIMEOUT, replies=replies, unanswered=[0], stacks={0: stack})
    assert (failure.rank, failure.kind) == (0, RankFailureKind.HUNG)
    message = str(failure)
    assert message.startswith("ranks [0] did not answer within 4.0 s (hung); ranks [1, 2] timed out in a collective "
                              "waiting for them; ranks [] answered normally.\n--- stack of rank 0 ---\n"), message
    assert "pool_selftest.py" in message and "frame 16\n" in message and "frame 15\n" not in message  # last 25 lines


def test_a_hang_with_healthy_peers_and_no_stack_dump():
    failure = diagnose(CASE, timeout=2.5, replies={0: ok(0), 1: ok(1)}, unanswered=[2], stacks={})
    assert (failure.rank, failure.kind) == (2, RankFailureKind.HUNG)
    assert str(failure).startswith("ranks [2] did not answer within 2.5 s (hung); ranks [0, 1] answered normally.\n")


def test_a_launcher_that_died_before_the_case_was_sent():
    failure = diagnose(CASE, timeout=TIMEOUT, replies={},
                       send_error=(0, "rank 0 could not be sent the case ([Errno 32] Broken pipe); it has probably exited"))
    assert (failure.rank, failure.kind, failure.outputs) == (0, RankFailureKind.EXITED, [])
    assert str(failure).startswith("rank 0 could not be sent the case ([Errno 32] Broken pipe)")


def test_a_launcher_that_died_during_the_case():
    # The launcher was killed (SIGKILL) and took its ranks with it before it could log any exit.
    failure = diagnose(CASE, timeout=TIMEOUT, replies={0: ok(0)}, closed=(1, "connection closed by peer after 0 of 8 "
                       "bytes"), launcher_exit=-9, exits=[], log="(no log)")
    assert (failure.rank, failure.kind) == (1, RankFailureKind.EXITED)
    message = str(failure)
    assert "fork exit code -9" in message and "fork log tail:\n(no log)" in message
    assert failure.outputs == [ok(0)]


def test_an_answer_out_of_protocol():
    body = {"op": "result", "case_id": 6, "rank": 1, "ok": True}
    try:
        decode_reply(body, {}, rank=1, case_id=7, received_at=0.0)
    except OffProtocol as exc:
        failure = diagnose(CASE, timeout=TIMEOUT, replies={0: ok(0)}, off_protocol=(1, str(exc)))
    assert (failure.rank, failure.kind) == (1, RankFailureKind.PROTOCOL)
    assert str(failure).startswith("rank 1 answered out of protocol: {'op': 'result', 'case_id': 6")


def test_decode_reply_reads_every_field():
    body = {"op": "result", "case_id": 7, "rank": 1, "ok": False, "info": {"a": 1}, "comm": [{"op": "x"}],
            "seconds": 0.5, "error_type": "E", "message": "m", "traceback": "t", "called": ["f"],
            "t_start": 1.0, "t_end": 2.0}
    out = decode_reply(body, {"y": 1}, rank=1, case_id=7, received_at=3.0)
    assert out == RankOutput(rank=1, ok=False, info={"a": 1}, tensors={"y": 1}, comm=[{"op": "x"}], seconds=0.5,
                             error_type="E", message="m", traceback="t", called=["f"], started_at=1.0,
                             finished_at=2.0, received_at=3.0)


def test_format_stacks_skips_ranks_without_a_dump():
    assert format_stacks({1: "a\n\n b\n"}, [0, 1]) == "--- stack of rank 1 ---\na\n b"


def test_a_start_failure_names_the_rank_that_ended_first_with_its_own_traceback():
    from cp_harness.ranks.diagnosis import start_failure_report

    exits = [(2, 1), (0, -9), (1, -9)]  # rank 2 exited with 1; the launcher then killed the others
    text = start_failure_report(exits, {2: "Traceback ...\nRuntimeError: injected\n", 0: "not this one"})
    assert text.startswith("rank 2 failed first during the start: it exited with 1")
    assert "--- traceback of rank 2 ---\nTraceback ...\nRuntimeError: injected" in text and "not this one" not in text
    killed = start_failure_report([(5, -9)], {})
    assert "rank 5 failed first during the start: it was killed by signal 9" in killed and "out of memory?" in killed
    assert start_failure_report([], {1: "x"}) == ""


def test_a_rank_that_exited_without_replying_shows_the_traceback_it_left():
    log = exit_line(3, 1234, 1, [0, 1, 2])
    failure = diagnose(CASE, timeout=TIMEOUT, replies={}, closed=(0, "connection closed by peer"), launcher_exit=1,
                       exits=exits_in_log(log), log=log, rank_errors={3: "Traceback\nValueError: left behind\n"})
    assert failure.rank == 3 and "--- traceback of rank 3 ---\nTraceback\nValueError: left behind" in str(failure)


def test_a_start_that_times_out_names_the_missing_ranks_and_where_the_others_got_to():
    from cp_harness.ranks.diagnosis import rank_ranges, start_timeout_report

    assert rank_ranges([0, 1, 2, 5, 7, 8, 9]) == "0-2, 5, 7-9"
    progress = {r: {"what": "joining the process group (gloo; store at 127.0.0.1:5000, waiting up to 252 s for 64 "
                            "ranks)", "pid": 100 + r, "node": 0, "host": "h", "at": 10.0} for r in range(48)}
    ready = list(range(40))
    text = start_timeout_report(world=64, ready=ready, progress=progress, exited={},
                                timeout_text="start timeout 252 s = 60 s + 3 s x 64 ranks", launcher="fork", nodes=1,
                                last_lines={r: f"line of rank {r}" for r in range(40, 60)}, now=40.0)
    assert text.startswith("rank pool did not start: the pool's start timeout 252 s = 60 s + 3 s x 64 ranks fired "
                           "with 40 of 64 ranks ready."), text
    assert "ranks that never connected: 48-63\n" in text and "  rank 48's last line: line of rank 48" in text, text
    assert "rank 60's last line" not in text  # no log: nothing invented
    assert "ranks connected but not ready: 40-47" in text, text
    assert "  rank 41 (pid 141): joining the process group (gloo; store at 127.0.0.1:5000" in text, text
    assert "30 s ago; its last line: line of rank 41" in text, text
    gone = start_timeout_report(world=4, ready=[], progress={}, exited={1: -9}, timeout_text="start timeout 72 s",
                                launcher="torchrun", nodes=2, last_lines={}, now=0.0)
    assert gone.startswith("rank pool did not start: the torchrun launcher exited (exit code node 1: -9)"), gone
    assert "ranks that never connected: 0-3" in gone and "no rank log here" in gone, gone


def dump(innermost: str, runner: bool = True) -> str:
    """A faulthandler dump of a rank: a watcher thread, then the thread running the case (innermost frame first)."""
    case_frames = ('  File "/w/cp_harness/checks/pool_selftest.py", line 55 in _rank\n'
                   + ('  File "/w/cp_harness/ranks/worker.py", line 303 in main\n' if runner else ""))
    return ('Thread 0x00007f01 (most recent call first):\n'
            '  File "/w/cp_harness/ranks/startup.py", line 244 in watch\n'
            '  File "/usr/lib/python3.11/threading.py", line 982 in run\n'
            'Current thread 0x00007f02 (most recent call first):\n'
            f'  File "{innermost}", line 3252 in all_reduce\n' + case_frames)


C10D = "/venv/site-packages/torch/distributed/distributed_c10d.py"


def test_a_rank_waits_in_a_collective_when_its_case_thread_is_inside_torch_distributed():
    assert collective_wait(dump(C10D)).startswith(f'File "{C10D}", line 3252')
    assert collective_wait(dump("/w/cp_harness/checks/pool_selftest.py")) is None  # computing, not waiting
    assert collective_wait(dump(C10D, runner=False)) is None  # no thread of the case runner in the dump
    assert collective_wait("") is None  # the rank wrote nothing


def test_peers_are_blocked_only_when_two_looks_in_a_row_find_each_at_the_same_collective_frame():
    blocked = {0: dump(C10D), 2: dump(C10D)}
    assert blocked_in_collectives([blocked, blocked], [0, 2])
    assert not blocked_in_collectives([blocked], [0, 2])  # one look: a collective among them may be completing
    computing = {0: dump(C10D), 2: dump("/w/cp_harness/checks/pool_selftest.py")}
    assert not blocked_in_collectives([computing, computing], [0, 2])  # rank 2 may still reach the collective
    moved = {0: dump(C10D), 2: dump(C10D).replace("line 3252", "line 4750")}
    assert not blocked_in_collectives([blocked, moved], [0, 2])  # rank 2 went on to another collective
    assert not blocked_in_collectives([blocked, {0: dump(C10D)}], [0, 2])  # rank 2 wrote no dump the second time


def test_a_rank_waiting_on_a_communication_handle_waits_too_as_its_source_line_says():
    exchange = "/w/cp_impl/_transport.py"
    lines = {(exchange, 3252): "            work.wait()", ("/w/cp_impl/model.py", 3252): "    out = a @ b"}

    def source_line(path: str, line: int) -> str:
        return lines.get((path, line), "")

    assert collective_wait(dump(exchange), source_line).startswith(f'File "{exchange}", line 3252')
    assert collective_wait(dump("/w/cp_impl/model.py"), source_line) is None  # a matmul: computing
    assert collective_wait(dump("/w/cp_impl/gone.py"), source_line) is None  # a line that cannot be read
    waiting = {0: dump(exchange), 2: dump(C10D)}
    assert blocked_in_collectives([waiting, waiting], [0, 2], source_line)
