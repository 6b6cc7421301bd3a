"""Fuzzing the layout functions with arbitrary (also invalid) metadata, in process (one rank, no mesh).

For every generated batch the implementation must either raise the documented
error -- ``ValueError`` or ``TypeError`` naming a field, with the batch exactly
as it was -- or return a result that satisfies every invariant of the SPEC:
padding exactly where the oracle's layout has it, positions equal to the
oracle's on real tokens, every position rule of ``validate_document_positions``,
documents never resumed after a gap, and "same document" (``j >= i -
position_ids[i]``) meaning what the oracle's document ids say. Never a crash
(another exception), a hang (a 10 s alarm) or a silent wrong answer.

Validity is decided independently of the implementation: lengths and masks by
the oracle (``oracle.layout`` raises ``ValueError`` for malformed ones), given
``position_ids`` by the SPEC (packed rows: equal to the pack on real tokens;
unpacked rows: the position rules), ``num_chunks`` by the SPEC (positive,
divides the batch size; a mistral_large4 pack: equals it). The implementation
must raise if and only if something is invalid. Where the two may legitimately
differ is listed in docs/reliability.md (error types, values at padding,
given positions of unpacked rows).
"""

from __future__ import annotations

import contextlib
import re
import signal
from typing import Any

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from cp_harness.cases.descriptions import FILLER, IGNORE_INDEX
from cp_harness.cases.malformed_inputs import input_changes, snapshot_inputs
from cp_harness.cases.profiles import examples
from cp_harness.usage.resolve_sharder import hook_sharder, local_token_indices, sharded
from oracle.layout import layout_from_attention_mask, layout_from_batch

CALL_LIMIT_S = 10

# ------------------------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def time_limit(seconds: int = CALL_LIMIT_S):
    """Fail (instead of hanging the suite) when the call takes longer than ``seconds``."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"the call did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def position_violations(keep: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int]]:
    """Every ``(row, column)`` breaking the SPEC's position rules (written independently of any implementation)."""
    bad = []
    for b in range(keep.shape[0]):
        prev_kept, seen, prev = False, False, 0
        for t in range(keep.shape[1]):
            if not bool(keep[b, t]):
                prev_kept = False
                continue
            p = int(positions[b, t])
            if p < 0 or (prev_kept and p not in (prev + 1, 0)) or (not prev_kept and seen and p != 0):
                bad.append((b, t))
            prev_kept, seen, prev = True, True, p
    return bad


def same_document_problems(keep: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor) -> list[str]:
    """Where "kept ``j <= i`` with ``j >= i - positions[i]``" differs from "same document as ``i``"."""
    problems = []
    for b in range(keep.shape[0]):
        for i in range(keep.shape[1]):
            if not bool(keep[b, i]):
                continue
            by_position = {j for j in range(i + 1) if bool(keep[b, j]) and j >= i - int(positions[b, i])}
            by_document = {j for j in range(i + 1) if bool(keep[b, j]) and int(documents[b, j]) == int(documents[b, i])}
            if by_position != by_document:
                problems.append(
                    f"row {b}, token {i}: positions give {sorted(by_position)}, documents {sorted(by_document)}"
                )
    return problems


def names_a_field(message: str, fields) -> bool:
    return any(field in message for field in fields)


def attempt(call, inputs: dict):
    """``(error or None, changes to the inputs)``; errors other than ValueError/TypeError propagate (a crash)."""
    snap = snapshot_inputs(inputs)
    error = None
    with time_limit():
        try:
            call()
        except (ValueError, TypeError) as exc:
            error = exc
    return error, input_changes(inputs, snap) if error is not None else []


# --------------------------------------------------------------------------------------- strategies
ODD_LENGTHS = st.one_of(
    st.integers(-3, -1), st.integers(0, 16), st.sampled_from([FILLER, -999, -1001, 2**62, 2**63 - 1, -(2**63)])
)


@st.composite
def packed_metadata(draw, rows: int | None = None) -> dict:
    """``input_ids``, ``seq_lens``, ``seq_lens_padded`` (and sometimes ``qkv_format``): often valid, often not."""
    B = rows if rows is not None else draw(st.integers(1, 3))
    S = draw(st.integers(1, 12))
    D = draw(st.integers(0, 4))
    real = torch.full((B, D), FILLER, dtype=torch.int64)
    padded = torch.full((B, D), FILLER, dtype=torch.int64)
    for b in range(B):
        used = 0
        for d in range(draw(st.integers(0, D))):
            room = max(S - used, 0)  # documents that fit; the corruptions below break them
            r = draw(st.integers(0, room))
            real[b, d], padded[b, d] = r, r + draw(st.integers(0, min(3, room - r)))
            used += int(padded[b, d])
    corruption = draw(st.sampled_from(("none", "none", "none", "none", "element", "element", "shape", "dtype", "huge")))
    if corruption == "huge" and D:  # lengths whose int64 sum wraps around
        b = draw(st.integers(0, B - 1))
        padded[b, :] = draw(st.sampled_from((2**62, 2**63 - 1, 2**61 + 1)))
        real[b, :] = torch.where(real[b, :] == FILLER, 1, real[b, :])
    elif corruption == "element" and D:
        target = draw(st.sampled_from((real, padded)))
        target[draw(st.integers(0, B - 1)), draw(st.integers(0, D - 1))] = draw(ODD_LENGTHS)
    elif corruption == "shape":
        how = draw(st.sampled_from(("drop_column", "drop_row", "flatten", "extra_row")))
        if how == "drop_column" and D:
            real = real[:, :-1]
        elif how == "drop_row" and B > 1:
            real, padded = real[:-1], padded[:-1]
        elif how == "flatten":
            real, padded = real.reshape(-1), padded.reshape(-1)
        elif how == "extra_row":
            real, padded = torch.cat([real, real[:1]]), torch.cat([padded, padded[:1]])
    elif corruption == "dtype":
        dtype = draw(st.sampled_from((torch.int32, torch.float32, torch.bool)))
        real, padded = real.to(dtype), padded.to(dtype)
    batch: dict[str, Any] = {
        "input_ids": torch.arange(B * S).view(B, S) % 5,
        "seq_lens": real.clone(),
        "seq_lens_padded": padded.clone(),
    }
    if draw(st.booleans()):
        batch["qkv_format"] = "thd"
    return batch


@st.composite
def attention_mask_metadata(draw) -> dict:
    """``input_ids`` and an ``attention_mask`` with left/right/two-sided padding, holes or odd values."""
    B, S = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    mask = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        lo = draw(st.integers(0, S))
        mask[b, lo : draw(st.integers(lo, S))] = 1
    for _ in range(draw(st.integers(0, 2))):  # holes, odd values
        mask[draw(st.integers(0, B - 1)), draw(st.integers(0, S - 1))] = draw(st.sampled_from((0, 1, 1, 2, -1)))
    if draw(st.booleans()):
        mask = mask.to(torch.bool) if bool(((mask == 0) | (mask == 1)).all()) else mask
    return {"input_ids": torch.arange(B * S).view(B, S) % 5, "attention_mask": mask}


@st.composite
def with_positions_and_labels(draw, batch: dict, layout_fn) -> dict:
    """Maybe add ``position_ids`` (right, slightly wrong, or arbitrary) and ``labels``."""
    B, S = batch["input_ids"].shape
    kind = draw(st.sampled_from(("none", "right", "tweaked", "tweaked", "arbitrary", "restart")))
    layout = None
    with contextlib.suppress(ValueError, TypeError, RuntimeError, IndexError):
        layout = layout_fn(batch)
    if kind in ("right", "tweaked", "restart") and layout is not None:
        positions = layout.positions.clone()
        kept = layout.keep.nonzero().tolist() or [[0, 0]]
        b, t = draw(st.sampled_from(kept))  # a real token, where a change matters
        if kind == "tweaked":
            positions[b, t] += draw(st.sampled_from((-1, 1, 3)))
        elif kind == "restart":
            positions[b, t] = 0
        batch["position_ids"] = positions
    elif kind == "arbitrary":
        batch["position_ids"] = torch.tensor(draw(st.lists(st.integers(-2, 8), min_size=B * S, max_size=B * S))).view(
            B, S
        )
    if draw(st.booleans()):
        batch["labels"] = (torch.arange(B * S).view(B, S) * 7) % 11 - 1
    return batch


def packed_layout_of(batch: dict):
    return layout_from_batch(
        {"input_ids": batch["input_ids"], "seq_lens": batch["seq_lens"], "seq_lens_padded": batch["seq_lens_padded"]}
    )


def mask_layout_of(batch: dict):
    mask = batch["attention_mask"]
    if tuple(mask.shape) != tuple(batch["input_ids"].shape):
        raise ValueError("attention_mask shape")
    return layout_from_attention_mask(mask)


# ------------------------------------------------------------------------------------ the verdicts


def expected_problems(batch: dict, layout_fn, *, packed: bool, num_chunks=None, exact_chunks=False):
    """``(layout or None, malformed fields)``: what the implementation must reject, decided without it."""
    problems = []
    B = batch["input_ids"].shape[0]
    if num_chunks is not None and (num_chunks < 1 or B % num_chunks or (exact_chunks and num_chunks != B)):
        problems.append("num_chunks")
    try:
        layout = layout_fn(batch)
    except ValueError:
        return None, problems + (["seq_lens"] if packed else ["attention_mask"])
    given = batch.get("position_ids")
    if given is not None:
        if packed:
            if bool((layout.keep & (given != layout.positions)).any()):
                problems.append("position_ids")
        elif position_violations(layout.keep, given):
            problems.append("position_ids")
    return layout, problems


def check_normalised(batch: dict, before: dict, layout, *, packed: bool) -> None:
    """The batch after a successful hook: every SPEC invariant against the oracle's layout."""
    for key in ("seq_lens", "seq_lens_padded", "qkv_format"):
        assert key not in batch or not packed, f"{key} must be removed from a packed batch"
    for key in ("input_ids", "labels"):
        if key in before:
            assert batch[key] is before[key] and torch.equal(batch[key], before[key + "#copy"]), f"{key} changed"
    keep = layout.keep
    assert batch["padding_mask"].dtype == torch.bool and torch.equal(batch["padding_mask"], ~keep), (
        f"padding_mask {batch['padding_mask'].tolist()} but the layout keeps {keep.tolist()}"
    )
    positions = batch["position_ids"]
    assert positions.dtype == torch.int64 and positions.shape == keep.shape
    given = before.get("position_ids#copy")
    if packed or given is None:
        assert torch.equal(positions[keep], layout.positions[keep]), (
            f"positions {positions.tolist()} differ from the layout's {layout.positions.tolist()} on real tokens"
        )
        documents = layout.document_ids
    else:  # unpacked rows with valid given positions: those, or the derived ones (docs/reliability.md)
        assert torch.equal(positions[keep], given[keep]) or torch.equal(positions[keep], layout.positions[keep]), (
            f"positions {positions.tolist()} are neither the given {given.tolist()} nor the derived ones"
        )
        documents = None
    assert not position_violations(keep, positions), f"position rules broken at {position_violations(keep, positions)}"
    if documents is not None:
        problems = same_document_problems(keep, positions, documents)
        assert not problems, "documents resumed or merged:\n" + "\n".join(problems)


def run_hook(call, batch: dict, layout, problems: list[str], *, packed: bool):
    before = dict(batch)
    for key in ("input_ids", "labels", "position_ids"):
        if key in batch:
            before[key + "#copy"] = batch[key].clone()
    error, changes = attempt(call, {"batch": batch})
    event(f"rejected: {', '.join(problems)}" if error is not None else "accepted")
    if error is not None:
        assert problems, f"a valid batch was rejected: {type(error).__name__}: {error}"
        assert names_a_field(str(error), problems), f"the error names none of {problems}: {error}"
        assert not changes, f"the batch changed although the call failed: {changes}"
        return False
    assert not problems, f"accepted although {problems} {'is' if len(problems) == 1 else 'are'} malformed"
    check_normalised(batch, before, layout, packed=packed)
    return True


# -------------------------------------------------------------------------------------------- tests


@settings(max_examples=examples(1.0))
@given(data=st.data())
@example(data=None)  # the overflow that once passed: padded lengths whose int64 sum wraps around
def test_unpack_row_layout_fuzz(cp_impl, data):
    if data is None:
        batch = {
            "input_ids": torch.zeros(1, 6, dtype=torch.int64),
            "seq_lens": torch.tensor([[1, 1, 1]]),
            "seq_lens_padded": torch.tensor([[2**62, 2**62, 3]]),
        }
    else:
        batch = data.draw(packed_metadata())
        batch = data.draw(with_positions_and_labels(batch, packed_layout_of))
    layout, problems = expected_problems(batch, packed_layout_of, packed=True)
    run_hook(lambda: cp_impl.inkling2.unpack_row_layout(batch), batch, layout, problems, packed=True)


@settings(max_examples=examples(1.0))
@given(data=st.data())
def test_prepare_hooks_fuzz(cp_impl, data):
    model = data.draw(st.sampled_from(("inkling2", "mistral_large4")))
    packed = data.draw(st.booleans())
    if packed:
        batch = data.draw(packed_metadata())
        layout_fn = packed_layout_of
    else:
        batch = data.draw(attention_mask_metadata())
        layout_fn = mask_layout_of
    batch = data.draw(with_positions_and_labels(batch, layout_fn))
    exact = packed and model == "mistral_large4"  # one packed row per micro-batch
    B = batch["input_ids"].shape[0]
    fitting = [B] if exact else [d for d in range(1, B + 1) if B % d == 0]
    num_chunks = data.draw(st.one_of(st.sampled_from(fitting), st.sampled_from(fitting), st.integers(-1, 4)))
    layout, problems = expected_problems(batch, layout_fn, packed=packed, num_chunks=num_chunks, exact_chunks=exact)
    module = getattr(cp_impl, model)
    if not run_hook(
        lambda: module.prepare_cp_inputs(batch, num_chunks=num_chunks), batch, layout, problems, packed=packed
    ):
        return
    # One rank: the local batch, put at the global positions the sharder reports, is the global one (whatever
    # the layout's divisibility padding).
    sharder = hook_sharder(module.prepare_cp_inputs(batch, num_chunks=num_chunks), None)
    S = batch["input_ids"].shape[1]
    with sharded(sharder, batch) as shard:  # read inside the sharder's context, as a train step does
        indices = local_token_indices(sharder, None, shard.local["padding_mask"].shape[1])
        order = torch.argsort(indices)[:S]
        local = {
            k: shard.local[k].index_select(1, order)
            for k in ("padding_mask", "position_ids", "labels")
            if k in shard.local
        }
    keep = layout.keep
    assert torch.equal(local["padding_mask"], ~keep)
    assert torch.equal(local["position_ids"][keep], batch["position_ids"][keep])
    if "labels" in batch:
        expected = batch["labels"]
        if exact:  # the label of each document's first token is masked
            docs = layout.document_ids
            first = torch.zeros_like(keep)
            first[:, 0] = True
            first[:, 1:] = docs[:, 1:] != docs[:, :-1]
            expected = torch.where(first & (docs >= 0), IGNORE_INDEX, expected)
        assert torch.equal(local["labels"][keep], expected[keep]), f"labels {local['labels'].tolist()}"


@st.composite
def keep_and_positions(draw):
    B, S = draw(st.integers(1, 3)), draw(st.integers(1, 10))
    keep = torch.tensor(draw(st.lists(st.booleans(), min_size=B * S, max_size=B * S))).view(B, S)
    style = draw(st.sampled_from(("valid", "valid", "arbitrary", "malformed")))
    if style == "arbitrary":
        positions = torch.tensor(draw(st.lists(st.integers(-2, 6), min_size=B * S, max_size=B * S))).view(B, S)
    else:  # build valid positions: documents restart at 0 at random kept tokens and after every gap
        positions = torch.zeros(B, S, dtype=torch.int64)
        for b in range(B):
            offset = draw(st.integers(0, 4))  # the first real span may start mid-document
            count, prev_kept, seen = offset, False, False
            for t in range(S):
                if bool(keep[b, t]):
                    if seen and (not prev_kept or draw(st.integers(0, 4)) == 0):
                        count = 0
                    positions[b, t] = count
                    count += 1
                    seen, prev_kept = True, True
                else:
                    positions[b, t] = draw(st.integers(-5, 9))  # padding values are free
                    prev_kept = False
    if style == "malformed":
        how = draw(st.sampled_from(("keep_int", "positions_float", "shape", "one_dimensional")))
        if how == "keep_int":
            keep = keep.long()
        elif how == "positions_float":
            positions = positions.float()
        elif how == "shape":
            positions = positions[:, :-1] if S > 1 else positions[:0]
        else:
            keep, positions = keep.reshape(-1), positions.reshape(-1)
    return keep, positions


@settings(max_examples=examples(1.0))
@given(pair=keep_and_positions())
@example(pair=(torch.tensor([[True, True, False, True]]), torch.tensor([[0, 1, 2, 2]])))  # a gap resumes a document
@example(pair=(torch.tensor([[False, True, True]]), torch.tensor([[7, 3, 4]])))  # mid-document start after padding
def test_validate_document_positions_fuzz(cp_impl, pair):
    keep, positions = pair
    malformed = (
        keep.dtype != torch.bool
        or positions.dtype.is_floating_point
        or keep.dim() != 2
        or keep.shape != positions.shape
    )
    violations = [] if malformed else position_violations(keep, positions)
    inputs = {"keep": keep, "positions": positions}
    error, changes = attempt(lambda: cp_impl.inkling2.validate_document_positions(keep, positions), inputs)
    assert not changes, f"the inputs changed: {changes}"
    event("accepted" if error is None else "rejected")
    if error is None:
        assert not malformed, "malformed arguments were accepted"
        assert not violations, f"positions breaking the rules at {violations} were accepted"
        return
    assert malformed or violations, f"valid positions were rejected: {error}"
    message = str(error)
    if malformed:
        assert names_a_field(message, ("keep", "positions")), message
        return
    assert isinstance(error, ValueError), f"a rule violation must be a ValueError, got {type(error).__name__}"
    numbers = {int(x) for x in re.findall(r"\d+", message)}
    assert any(b in numbers and t in numbers for b, t in violations), (
        f"the message names no row and column of a violation {violations}: {message}"
    )
