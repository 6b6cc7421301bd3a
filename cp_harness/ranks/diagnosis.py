"""Which rank failed a case, and how: a pure function of what the pool observed.

``diagnose`` takes plain data -- the replies that came back, the ranks that
did not answer, a connection that closed, which ranks the launcher saw exit
(and with what code or signal), the launcher's log, the stacks of stuck ranks,
the case and its timeout -- and returns the ``RankFailure`` to raise, or
``None`` when every rank answered normally. No process is needed to call it,
so each kind of failure is testable on its own (``tests/ranks/test_pool_diagnosis.py``);
the pool (``tickets``) gathers the evidence and tears itself down after a failure. The one thing read from
outside the arguments: whether a stuck rank's innermost line waits on a communication handle
(``collective_wait``), from the source file (``linecache``; tests pass their own ``source_line``).
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from cp_harness.ranks.outputs import RankFailure, RankFailureKind, RankOutput

# How the fork launcher (``worker.launch``) reports a rank that exited abnormally: the first such line names
# the rank that started the failure; the launcher then ends the others (their lines follow, with -9).
_EXIT_PREFIX = "cp_harness.ranks.worker: rank"
_EXITED = re.compile(r"^cp_harness\.ranks\.worker: rank (\d+) \(pid \d+\) exited with (-?\d+)", re.MULTILINE)
STACK_LINES = 25  # lines of each stuck rank's stack dump that a failure shows


def exit_line(rank: int, pid: int, code: int, others: Iterable[int]) -> str:
    """The launcher's log line for a rank that exited with ``code`` (negative: killed by that signal)."""
    return f"{_EXIT_PREFIX} {rank} (pid {pid}) exited with {code}; ending ranks {sorted(others)}"


def exits_in_log(log: str) -> list[tuple[int, int]]:
    """``(rank, exit code)`` of each abnormal exit the fork launcher logged, first first (none under torchrun)."""
    return [(int(rank), int(code)) for rank, code in _EXITED.findall(log)]


def start_failure_report(exits: Sequence[tuple[int, int]], rank_errors: Mapping[int, str]) -> str:
    """Which rank ended first while the pool started, how, and its own traceback (``rank_errors``: what each
    forked rank that ended with an exception left); empty when the launcher logged no exit. The log's tail
    shows the ranks the launcher ended after it, not the cause."""
    if not exits:
        return ""
    rank, code = exits[0]
    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
    own = rank_errors.get(rank)
    return f"rank {rank} failed first during the start: it {how}; the launcher then ended the others.\n" + (
        f"--- traceback of rank {rank} ---\n{own}"
        if own
        else f"(rank {rank} left no traceback{': out of memory?' if code == -9 else ''})\n"
    )


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


START_LINES = 16  # ranks a start failure lists one by one (the rest are counted)


def start_timeout_report(
    *,
    world: int,
    ready: Sequence[int],
    progress: Mapping[int, dict],
    exited: Mapping[int, int],
    timeout_text: str,
    launcher: str,
    nodes: int,
    last_lines: Mapping[int, str | None],
    now: float,
) -> str:
    """Why a pool did not come up: which timeout fired (or which launcher ended), the ranks that never
    connected and the last line each wrote, and for every rank that connected but was not ready, the step of
    its start it was at (``progress``: its last phase message, with ``at`` its arrival time)."""
    if exited:
        which = ", ".join(f"node {n}: {code}" if nodes > 1 else str(code) for n, code in sorted(exited.items()))
        head = (
            f"rank pool did not start: the {launcher} launcher exited (exit code {which}) with {len(ready)} of "
            f"{world} ranks ready."
        )
    else:
        head = f"rank pool did not start: the pool's {timeout_text} fired with {len(ready)} of {world} ranks ready."
    lines = [head]
    never = [r for r in range(world) if r not in progress and r not in ready]
    if never:
        lines.append(f"ranks that never connected: {rank_ranges(never)}")
        shown = [r for r in never if last_lines.get(r)][:START_LINES]
        lines += [f"  rank {r}'s last line: {last_lines[r]}" for r in shown]
        quiet = [r for r in never if last_lines.get(r) is None]
        if quiet and len(quiet) == len(never):
            lines.append("  (no rank log here: ranks started elsewhere, or their launcher never started them)")
    waiting = [r for r in sorted(progress) if r not in ready]
    if waiting:
        lines.append(f"ranks connected but not ready: {rank_ranges(waiting)}")
        for r in waiting[:START_LINES]:
            p = progress[r]
            where = f", node {p.get('node')} on {p.get('host')}" if nodes > 1 else ""
            since = f", {now - p['at']:.0f} s ago" if "at" in p else ""
            last = last_lines.get(r)
            lines.append(
                f"  rank {r} (pid {p.get('pid')}{where}): {p.get('what')}{since}"
                + (f"; its last line: {last}" if last else "")
            )
        if len(waiting) > START_LINES:
            lines.append(f"  ... and {len(waiting) - START_LINES} more ranks")
    return "\n".join(lines) + "\n"


def looks_like_timeout(message: str | None) -> bool:
    """Whether a rank's error is a consequence of a peer's failure (it gave up waiting, or lost the peer)."""
    text = (message or "").lower()
    return any(
        sign in text
        for sign in ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe")
    )


_CASE_RUNNER = "cp_harness/ranks/worker.py"  # a frame of the thread that runs the rank's cases
_COLLECTIVES = "/torch/distributed/"  # where a blocking collective's innermost Python frame lies
_FRAME = re.compile(r'^File "(?P<path>[^"]+)", line (?P<line>\d+) in ')
_WAIT_CALL = re.compile(r"\.wait\(\s*\)")  # ``work.wait()``: a communication handle waited on from Python


def collective_wait(stack: str, source_line: Callable[[str, int], str] = linecache.getline) -> str | None:
    """Where a rank waits for communication, from one faulthandler dump (every thread, innermost frame first): the
    innermost frame of the thread that runs the rank's cases when that frame is in ``torch.distributed`` or its
    source line (``source_line(path, line)``) waits on a communication handle (``work.wait()``: a C++ call, which
    the dump shows as the caller's line); else None (computing, waiting elsewhere, or no such thread)."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip()):
        frames = [line.strip() for line in block.splitlines()[1:] if line.strip().startswith("File ")]
        if not frames or not any(_CASE_RUNNER in frame for frame in frames):
            continue
        innermost = frames[0]
        if _COLLECTIVES in innermost.replace("\\", "/"):
            return innermost
        where = _FRAME.match(innermost)
        if where and _WAIT_CALL.search(source_line(where["path"], int(where["line"])) or ""):
            return innermost
        return None
    return None


def blocked_in_collectives(
    looks: Sequence[Mapping[int, str]],
    ranks: Iterable[int],
    source_line: Callable[[str, int], str] = linecache.getline,
) -> bool:
    """Whether every rank of ``ranks`` waited for communication (``collective_wait``), at the same frame, in each of
    the stack dumps ``looks`` (two or more, taken in turn while a peer of theirs had already raised): peers that
    cannot answer without it. One look is not enough (a collective among the peers alone may be completing)."""
    ranks = list(ranks)
    if len(looks) < 2 or not ranks:
        return False
    waits = [{rank: collective_wait(look.get(rank, ""), source_line) for rank in ranks} for look in looks]
    return all(wait is not None for wait in waits[0].values()) and all(w == waits[0] for w in waits[1:])


def format_stacks(stacks: Mapping[int, str], ranks: Sequence[int]) -> str:
    """The stack dumps of ``ranks`` (those that wrote one), the last ``STACK_LINES`` non-blank lines of each."""
    parts = []
    for rank in ranks:
        if rank not in stacks:
            continue
        lines = [line for line in stacks[rank].splitlines() if line.strip()]
        parts.append(f"--- stack of rank {rank} ---\n" + "\n".join(lines[-STACK_LINES:]))
    return "\n".join(parts)


def diagnose(
    case: dict,
    *,
    timeout: float,
    replies: Mapping[int, RankOutput],
    unanswered: Sequence[int] = (),
    launcher: str = "fork",
    send_error: tuple[int, str] | None = None,
    closed: tuple[int, str] | None = None,
    off_protocol: tuple[int, str] | None = None,
    launcher_exit: int | None = None,
    exits: Sequence[tuple[int, int]] = (),
    log: str = "",
    stacks: Mapping[int, str] | None = None,
    rank_errors: Mapping[int, str] | None = None,
    lost: tuple[int, str] | None = None,
    where: str = "",
    rank_logs: Mapping[int, str | None] | None = None,
) -> RankFailure | None:
    """The failure of ``case`` from what the pool observed, or ``None`` when every rank answered normally.

    ``replies``: rank -> its decoded reply, in the order they arrived. ``unanswered``: ranks that sent no
    reply within ``timeout`` seconds (or before the wait stopped). ``send_error``: ``(rank, message)`` when
    the case could not be sent to a rank. ``closed``: ``(rank, wire error)`` when a rank's connection closed
    instead of replying. ``off_protocol``: ``(rank, message)`` when a rank sent something else than its reply.
    ``launcher_exit``: the launcher's exit code (``None``: still running). ``exits``: ``(rank, exit code)``
    of the ranks the launcher saw exit, first first (``exits_in_log``; a negative code is a signal).
    ``log``: the tail of the launcher's log. ``stacks``: rank -> its stack dump (stuck ranks only).
    ``rank_errors``: rank -> the traceback a forked rank left when it ended with an exception.
    ``lost``: ``(rank, why)`` when a rank said its launcher is gone (a lost node) and exited. ``where``: lines
    saying where the case's ranks are (CP groups of a world mesh, nodes), added to the message. ``rank_logs``:
    rank -> the last lines of its own log (shown for a rank that exited without a traceback).
    """
    outputs = list(replies.values())
    if lost is not None:
        rank, why = lost
        ended = f"; launcher exit code {launcher_exit}" if launcher_exit is not None else ""
        return _failure(
            case,
            f"rank {rank} exited while running the case: {why}{ended}. Its node is lost; its "
            f"peers cannot finish the case.",
            rank=rank,
            kind=RankFailureKind.EXITED,
            outputs=outputs,
            where=where,
        )
    if send_error is not None:
        rank, message = send_error
        return _failure(case, message, rank=rank, kind=RankFailureKind.EXITED, outputs=[], where=where)
    if closed is not None:
        rank, error = closed
        # The fork launcher ends the other ranks when one exits, so the first closed connection may be a rank
        # it ended; it logs which rank exited first.
        culprit = exits[0][0] if exits else rank
        seen = "" if culprit == rank else f"; rank {rank}'s connection closed when the launcher ended it"
        own = replies.get(culprit)
        # A rank that replied before exiting (SystemExit in the case) left its own traceback in the reply.
        left = (rank_errors or {}).get(culprit)
        told = (
            f"--- traceback of rank {culprit} ---\n{own.traceback}\n"
            if own is not None and not own.ok and own.traceback
            else f"--- traceback of rank {culprit} ---\n{left}"
            if left
            else f"--- last lines of rank {culprit} ---\n{(rank_logs or {})[culprit]}\n"
            if (rank_logs or {}).get(culprit)
            else ""
        )
        return _failure(
            case,
            f"rank {culprit} exited while running the case ({error}{seen}; "
            f"{launcher} exit code {launcher_exit}).\n{told}"
            f"{launcher} log tail:\n{log}",
            rank=culprit,
            kind=RankFailureKind.EXITED,
            outputs=outputs,
            where=where,
        )
    if off_protocol is not None:
        rank, message = off_protocol
        return _failure(case, message, rank=rank, kind=RankFailureKind.PROTOCOL, outputs=outputs, where=where)
    errors = sorted((o for o in outputs if not o.ok), key=lambda o: o.seconds)
    stuck = sorted(unanswered)
    if not stuck and not errors:
        return None
    # Something went wrong: name the rank that started it.
    dumps = format_stacks(stacks or {}, stuck)
    root = next((o for o in errors if not looks_like_timeout(o.message)), None)
    followers = [o.rank for o in errors if o is not root]
    if root is not None:
        return _failure(
            case,
            f"rank {root.rank} raised {root.error_type}: {root.message}\n"
            + (f"ranks {followers} then failed waiting for it.\n" if followers else "")
            + (f"ranks {stuck} then did not answer (waiting in a collective for it).\n" if stuck else "")
            + f"--- traceback of rank {root.rank} ---\n{root.traceback}{dumps}",
            rank=root.rank,
            kind=RankFailureKind.RAISED,
            outputs=outputs,
            where=where,
        )
    if stuck:
        return _failure(
            case,
            f"ranks {stuck} did not answer within {timeout:.1f} s (hung)"
            + (f"; ranks {followers} timed out in a collective waiting for them" if followers else "")
            + f"; ranks {sorted(set(replies) - set(followers))} answered normally.\n{dumps}",
            rank=stuck[0],
            kind=RankFailureKind.HUNG,
            outputs=outputs,
            where=where,
        )
    first = errors[0]
    return _failure(
        case,
        f"rank {first.rank} raised {first.error_type}: {first.message}\n{first.traceback}",
        rank=first.rank,
        kind=RankFailureKind.RAISED,
        outputs=outputs,
        where=where,
    )


def _failure(
    case: dict, message: str, *, rank: int | None, kind: RankFailureKind, outputs: list[RankOutput], where: str = ""
) -> RankFailure:
    return RankFailure(f"{message}\n{where}case: {case}", rank=rank, kind=kind, case=case, outputs=outputs)
