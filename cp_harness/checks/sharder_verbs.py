"""Check ``sharder_verbs``: the sharder's verbs on every tensor form, under every ``ShardLayout`` field.

After ``shard(batch)`` the sharder holds the ``ShardLayout`` its strategy reported, and the verbs
``shard_token_tensor(tensor, seq_dim, fill)`` / ``gather_token_tensor(tensor, seq_dim, trim, fill)`` must
accept and return tensors in the *caller's* coordinates, by these rules (nemo-automodel 0.7.0's
``ContextParallelSharder``, in this order of precedence):

- ``input_token_stream_positions`` (a repositioned layout, e.g. the packed re-pad of DeepSeek V4/V4.1's
  ``shard_cp_batch``): a tensor shaped exactly like the map ``[B, S_in]`` is scattered into ``[B, S_pad]``
  rows (``fill`` at every column no input token lands on; ``fill`` is required), then sharded on dim 1;
  ``gather(trim=True, fill=...)`` maps the padded rows back, ``fill`` at input slots whose token was dropped
  (map ``-1``). Only ``[B, S_in]`` tensors have input coordinates there (the map is per row and column).
- ``input_row_shape`` (a flat THD stream): a tensor whose leading dims are the rows ``[B, S]`` is flattened
  (``seq_dim`` is then 0, trailing dims kept); ``gather(local, seq_dim=0, trim=True)`` un-flattens.
- ``original_seq_len`` / ``padded_seq_len``: a tensor of ``padded_seq_len`` on ``seq_dim`` is sharded as it is;
  one of ``original_seq_len`` is right-padded with ``fill`` first (``fill=None``: ``ValueError``);
  ``gather(trim=True)`` narrows back to ``original_seq_len``; ``trim=False`` returns the padded stream.
- ``local_token_global_indices`` (a data-dependent layout): the index map, instead of the sharder's
  closed-form ``local_token_global_indices(cp_mesh, padded_seq_len, device)``.

Every result is judged bit for bit against the index map the sharder reports, forward and (float payloads)
backward through the round trip. Layouts (case key ``layout``): ``strategy``, the implementation's own
``prepare_cp_inputs`` hook on ``[B, S]`` rows (its ``shard_batch``, e.g. the framework's
``shard_batch_load_balanced`` through an adapter); ``packed``, its ``mistral_large4.prepare_packed_cp_inputs``
hook on packed rows (DeepSeek V4.1's ``shard_cp_batch`` re-pads them, through an adapter, and reports the
token positions); ``repositioned`` and ``thd``, a layout the harness
reports through the implementation's own sharder class and index map (``repositioned``: documents re-padded
to an alignment, the closed-form map; ``thd``: rows flattened, a per-row head-tail partition reported as
``local_token_global_indices``, as TE's THD path reports it). Upstream gradients are small integers, so
every sum is exact in every dtype (accumulation precision is ``sharder_roundtrip``'s business).

Case keys: ``model``, ``layout``, ``rows`` (B), ``seq_len`` (S; ``thd``: a multiple of ``2N``), ``batch``
(``packed``: the THD batch description), ``docs`` and
``align`` (``repositioned``: document lengths per row), ``dtype``/``value_dtype`` (the payload), ``forms``:
tensors to round-trip, each ``{"lead": [k] or [], "trail": [...], "coords": "caller" | "padded" | "nofill",
"fill": v, "trim": bool}``: shape ``[*lead, B, S_x, *trail]``, ``seq_dim = 1 + len(lead)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import torch
from hypothesis import strategies as st

from cp_harness.cases.descriptions import PAD_ID, build_batch
from cp_harness.cases.strategies import (
    FLOAT_DTYPES,
    VALUE_DTYPES,
    as_space,
    packed_layout,
    payload_dtypes,
    seeds,
    with_impl,
    with_payload,
    world_sizes,
)
from cp_harness.checks import Repro, VerifyRow, register
from cp_harness.checks._token_layout import judge_token_layout
from cp_harness.checks._verb_contract import (
    Fields,
    form_fill,
    form_shape,
    form_value,
    interpret,
    stream_to_caller,
    to_stream,
    trimmed,
    untrim_grad,
    upstream,
)
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport
from cp_harness.repro import sharding
from cp_harness.usage.resolve_sharder import hook_sharder, local_token_indices, resolve_sharder, sharded

PAYLOADS = FLOAT_DTYPES + VALUE_DTYPES


@dataclasses.dataclass(frozen=True)
class _FieldLayout:
    """The ``ShardLayout`` fields, for an implementation module that has no ``ShardLayout`` class."""

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None


def payload(case: dict) -> str:
    return case.get("value_dtype") or case["dtype"]


# ------------------------------------------------------------------ layouts the harness reports
def repositioned_map(case: dict) -> tuple[torch.Tensor, int]:
    """``([B, S_in] input position -> padded column, -1 for an input pad slot), S_pad``: each row's documents
    packed back to back in the input, then re-padded so that every document starts at a multiple of
    ``align``; ``S_pad`` a multiple of ``2N``."""
    docs, align, n = case["docs"], int(case["align"]), int(case["world_size"])
    s_in = max(sum(row) for row in docs) + int(case.get("tail", 0))
    positions = torch.full((len(docs), s_in), -1, dtype=torch.long)
    widest = 1
    for b, row in enumerate(docs):
        src = dst = 0
        for length in row:
            positions[b, src : src + length] = torch.arange(dst, dst + length)
            src, dst = src + length, dst + -(-length // align) * align
        widest = max(widest, dst)
    return positions, -(-widest // (2 * n)) * (2 * n)


def thd_partition(rank: int, n: int, rows: int, seq_len: int) -> torch.Tensor:
    """A data-dependent index map: each row of the flattened stream split in ``2N`` chunks, rank ``r`` owning
    chunks ``r`` and ``2N-1-r`` of every row (TE's THD partition of documents)."""
    chunk = seq_len // (2 * n)
    parts = []
    for b in range(rows):
        for c in (rank, 2 * n - 1 - rank):
            parts.append(torch.arange(b * seq_len + c * chunk, b * seq_len + (c + 1) * chunk))
    return torch.cat(parts)


def _harness_sharder(case: dict, ctx, hooked, mesh):
    """The implementation's own sharder class, resolved for ``mesh``, holding a strategy that reports the
    case's layout (the sharder's class, constructor, ``shard`` and verbs are the implementation's)."""
    module = importlib.import_module(type(hooked).__module__)
    layout_cls = getattr(module, "ShardLayout", _FieldLayout)
    n, B = int(case["world_size"]), int(case["rows"])
    index_map = hooked.local_token_global_indices
    if case["layout"] == "repositioned":
        positions, s_pad = repositioned_map(case)
        layout = layout_cls(padded_seq_len=s_pad, input_token_stream_positions=positions.to(ctx.device))
    else:
        S = int(case["seq_len"])
        captured = thd_partition(ctx.rank, n, B, S).to(ctx.device)
        layout = layout_cls(local_token_global_indices=captured, padded_seq_len=B * S, input_row_shape=(B, S))
        index_map = None  # data-dependent: the index map arrives with the layout

    def shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
        return contextlib.nullcontext, dict(batch), layout

    return resolve_sharder(type(hooked)(shard_batch=shard_batch, local_token_global_indices=index_map), mesh)


# ------------------------------------------------------------------ rank half
def _fields(sharder) -> Fields:
    layout = getattr(sharder, "shard_layout", None)
    rows = getattr(layout, "input_row_shape", None)
    positions = getattr(layout, "input_token_stream_positions", None)
    return Fields(
        getattr(layout, "original_seq_len", None),
        getattr(layout, "padded_seq_len", None),
        None if rows is None else tuple(int(r) for r in rows),
        None if positions is None else positions.detach().cpu().long(),
    )


def _everywhere(ok: bool, ctx, mesh) -> bool:
    """Whether ``ok`` holds on every rank of the case's mesh."""
    if mesh is None or int(mesh.size()) == 1:
        return ok
    flag = torch.tensor([int(ok)], device=ctx.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=mesh.get_group())
    return bool(flag.item())


def _run_forms(case: dict, ctx, sharder, mesh, f: Fields, info: dict, tensors: dict) -> None:
    dtype = payload(case)
    for i, form in enumerate(case["forms"]):
        shape, seq_dim = form_shape(case, form, f)
        fill = form_fill(form, dtype)
        x = form_value(case, i, shape, dtype).to(ctx.device)
        differentiable = x.is_floating_point()
        x.requires_grad_(differentiable)
        try:
            local = sharder.shard_token_tensor(x, seq_dim=seq_dim, fill=fill)
        except Exception as error:  # judged: nofill forms must raise, every other must not
            info[f"raised{i}"] = f"{type(error).__name__}: {error}"
        if not _everywhere(f"raised{i}" not in info, ctx, mesh):
            continue  # no rank gathers unless every rank has a shard (a gather on some ranks only would hang)
        _, dim = interpret(shape, seq_dim, f)
        out = sharder.gather_token_tensor(local, seq_dim=dim, trim=bool(form["trim"]), fill=fill)
        if differentiable:
            local.retain_grad()
            out.backward(upstream(case, i, ctx.rank, tuple(out.shape), dtype).to(ctx.device))
            tensors[f"local_grad{i}"], tensors[f"caller_grad{i}"] = local.grad, x.grad
        tensors[f"local{i}"], tensors[f"out{i}"] = local.detach(), out.detach()


def _caller_ids(case: dict, ctx) -> torch.Tensor:
    """The case's global ``input_ids [B, S]`` as the caller holds them (built again: ``shard`` may consume its batch)."""
    built = build_batch({"seed": case["seed"], "batch": case["batch"], "model": case.get("model", "inkling2")})
    return built["input_ids"].to(ctx.device)


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    model = case.get("model", "inkling2")
    B, S = int(case["rows"]), int(case["seq_len"])
    mesh = ctx.mesh_for(case)
    spec = case.get("batch") or {"format": "bshd", "seq_len": S, "rows": [[0, S]] * B}
    batch = build_batch({"seed": case["seed"], "batch": spec, "model": model})
    if case["layout"] == "packed":
        hooked = ctx.impl.mistral_large4.prepare_packed_cp_inputs(batch, num_chunks=B, shard_primary=True)
    else:
        hooked = getattr(ctx.impl, model).prepare_cp_inputs(batch)
    if case["layout"] in ("strategy", "packed"):
        sharder = hook_sharder(hooked, mesh)
    else:
        sharder, batch = _harness_sharder(case, ctx, hooked["cp_sharder"], mesh), {}
    info: dict = {}
    tensors: dict = {}
    with sharded(sharder, batch) as shard:  # the verbs are used inside the sharder's context, as in a train step
        f = _fields(sharder)
        info.update(original_seq_len=f.original, padded_seq_len=f.padded, rows=None if f.rows is None else list(f.rows))
        n = 1 if mesh is None else int(mesh.size())
        # [B, L] rows, or one flat THD stream [T_local] (a strategy that flattens the rows: input_row_shape)
        local_len = shard.local["labels"].shape[-1] if "labels" in shard.local else (f.padded or 0) // n
        indices = local_token_indices(sharder, mesh, local_len, ctx.device)
        # the caller's arange(S) (the padded stream's, for harness layouts), shaped to match no rows / map
        length = f.original if f.original is not None else n * len(indices)
        marker = torch.arange(length, device=ctx.device).view(1, 1, length)
        tensors.update(
            token_indices=indices,
            token_marker=sharder.shard_token_tensor(marker, seq_dim=2, fill=-1)[0, 0],
            local_slot=torch.zeros(1, local_len),
        )
        if f.positions is not None:
            tensors["positions"] = f.positions
        if case.get("tokens_held") and "input_ids" in shard.local:  # the batch's own shard, beside the verbs'
            tensors["held_input_ids"] = shard.local["input_ids"].reshape(-1)
            caller = _caller_ids(case, ctx)
            tensors["verb_input_ids"] = sharder.shard_token_tensor(caller, seq_dim=1, fill=PAD_ID).reshape(-1)
        if f.padded is not None:
            _run_forms(case, ctx, sharder, mesh, f, info, tensors)
    info["caller_changed_by_shard"] = shard.caller_changes
    return info, tensors


# ------------------------------------------------------------------ judge
def _expected_fields(case: dict) -> Fields | None:
    """What the harness's strategy reported (``None``: the implementation's own strategy)."""
    if case["layout"] == "repositioned":
        positions, s_pad = repositioned_map(case)
        return Fields(None, s_pad, None, positions)
    if case["layout"] == "thd":
        B, S = int(case["rows"]), int(case["seq_len"])
        return Fields(None, B * S, (B, S), None)
    return None


def _judge_fields(report: CaseReport, case: dict, outputs: list) -> Fields | None:
    o = outputs[0]
    f = Fields(
        o.info["original_seq_len"],
        o.info["padded_seq_len"],
        None if o.info["rows"] is None else tuple(o.info["rows"]),
        torch.as_tensor(o.tensors["positions"]).long() if "positions" in o.tensors else None,
    )
    want = _expected_fields(case)
    if want is None and f.positions is not None:  # the implementation's strategy repositioned the tokens
        B, S = int(case["rows"]), int(case["seq_len"])
        report.require(
            tuple(f.positions.shape) == (B, S),
            f"shard_layout.input_token_stream_positions is {list(f.positions.shape)}, the batch's rows are [{B}, {S}]",
        )
        report.require(f.padded is not None, "a repositioned layout without padded_seq_len")
        return f if f.padded is not None and tuple(f.positions.shape) == (B, S) else None
    if want is None and f.rows is not None:  # a flat THD stream of the batch's rows: no single original length
        B, S = int(case["rows"]), int(case["seq_len"])
        report.require(
            f.rows == (B, S) and f.padded == B * S,
            f"shard_layout.input_row_shape={f.rows}, padded_seq_len={f.padded}; the batch's rows are [{B}, {S}] "
            f"(a stream of {B * S} tokens)",
        )
        return f if f.rows == (B, S) and f.padded == B * S else None
    if want is None:
        S = int(case["seq_len"])
        report.require(
            f.original == S,
            f"shard_layout.original_seq_len={f.original}, the batch has {S} tokens a row "
            "(the verbs pad caller-coordinate tensors from it)",
        )
        report.require(
            f.padded is not None,
            "the strategy reported no padded_seq_len: the verbs cannot validate or pad a caller's tensor",
        )
        # Without original_seq_len (reported above) the caller's length of flat rows is unknown: no form is judged.
        return f if f.padded is not None and (f.original is not None or f.rows is not None) else None
    same = (
        f.original == want.original
        and f.padded == want.padded
        and f.rows == want.rows
        and (f.positions is None) == (want.positions is None)
        and (want.positions is None or f.positions is not None and torch.equal(f.positions, want.positions))
    )
    report.require(
        same,
        f"after shard() the sharder holds shard_layout fields original={f.original} padded={f.padded} "
        f"rows={f.rows} positions={'set' if f.positions is not None else None}; its strategy reported "
        f"original={want.original} padded={want.padded} rows={want.rows} "
        f"positions={'set' if want.positions is not None else None}",
    )
    return want if same else None


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    for o in outputs:
        for change in o.info.get("caller_changed_by_shard", []):
            report.problem(f"rank {o.rank}: {change}")
    f = _judge_fields(report, case, outputs)
    if f is None:
        return report
    seq_len = f.original if f.original is not None else f.padded
    assert seq_len is not None  # _judge_fields returns only fields with padded_seq_len
    reported = judge_token_layout(report, outputs, seq_len, local_name="local_slot")
    if reported is None:
        return report
    for o in outputs:
        if "held_input_ids" in o.tensors:
            report.add(
                compare_exact(
                    f"the sharded batch's input_ids = shard_token_tensor(input_ids)@rank{o.rank}",
                    o.tensors["held_input_ids"],
                    torch.as_tensor(o.tensors["verb_input_ids"]),
                    rank=o.rank,
                )
            )
    dtype = payload(case)
    for i, form in enumerate(case["forms"]):
        shape, seq_dim = form_shape(case, form, f)
        fill = form_fill(form, dtype)
        x = form_value(case, i, shape, dtype)
        what = (
            f"form {i} {list(shape)} seq_dim={seq_dim} fill={fill!r} trim={form['trim']}, "
            f"{interpret(shape, seq_dim, f)[0]} coordinates"
        )
        try:
            padded, dim = to_stream(x, seq_dim, fill, f)
        except ValueError:
            for o in outputs:
                report.require(
                    f"raised{i}" in o.info and o.info[f"raised{i}"].startswith("ValueError"),
                    f"rank {o.rank}: shard_token_tensor({what}) must raise ValueError (the pad value "
                    f"must be explicit), it "
                    + (f"raised {o.info[f'raised{i}']}" if f"raised{i}" in o.info else "returned a shard"),
                )
            continue
        raised = [(o.rank, o.info[f"raised{i}"]) for o in outputs if f"raised{i}" in o.info]
        if raised:
            report.problem(f"shard_token_tensor({what}) raised on ranks {raised}")
            continue
        out = trimmed(padded, dim, fill, f) if form["trim"] else padded
        grad_total = None
        if x.is_floating_point():
            total = sum(
                (upstream(case, i, o.rank, tuple(out.shape), dtype).double() for o in outputs),
                torch.zeros((), dtype=torch.float64),
            ).to(x.dtype)
            grad_total = untrim_grad(total, padded.shape, dim, bool(form["trim"]), f)
        for o, index_map in zip(outputs, reported.index_maps):
            owned = torch.as_tensor(index_map)
            report.add(
                compare_exact(
                    f"shard_token_tensor({what})@rank{o.rank}",
                    o.tensors[f"local{i}"],
                    padded.index_select(dim, owned),
                    rank=o.rank,
                )
            )
            report.add(
                compare_exact(f"gather_token_tensor({what})@rank{o.rank}", o.tensors[f"out{i}"], out, rank=o.rank)
            )
            if grad_total is None:
                continue
            local_grad = grad_total.index_select(dim, owned)
            report.add(
                compare_exact(
                    f"grad of the local shard ({what})@rank{o.rank}",
                    o.tensors[f"local_grad{i}"],
                    local_grad,
                    rank=o.rank,
                    gradient=True,
                )
            )
            own = torch.zeros_like(grad_total).index_copy(dim, owned, local_grad)
            report.add(
                compare_exact(
                    f"grad of the caller's tensor ({what})@rank{o.rank}",
                    o.tensors[f"caller_grad{i}"],
                    stream_to_caller(own, shape, seq_dim, f),
                    rank=o.rank,
                    gradient=True,
                )
            )
    return report


# ------------------------------------------------------------------ cases
_FILLS = {"bool": (0, 1), "int64": (0, -1)}


@st.composite
def _form(draw, layout: str, dtype: str) -> dict:
    nofill = ("nofill",) if layout in ("strategy", "packed") else ()
    coords = draw(st.sampled_from(("caller", "caller", "padded") + nofill))
    two_d = layout in ("repositioned", "packed") and coords != "padded"  # [B, S_in]: the map's own shape
    lead: list[int] = []
    if layout == "strategy" or coords == "padded":
        lead = draw(st.sampled_from(([], [], [3], [2])))  # [3, B, S]: mRoPE positions, seq_dim=2
    trail = [] if two_d else draw(st.lists(st.integers(1, 3), max_size=3 - len(lead)))
    # trim=True is asked where the caller's coordinates exist: padded-stream forms of thd / repositioned
    # layouts have none (the map is [B, S_in]; the rows are [B, S]).
    trim = draw(st.booleans()) if (layout == "strategy" or coords != "padded") else False
    return {
        "lead": lead,
        "trail": trail,
        "coords": coords,
        "trim": trim,
        "fill": draw(st.sampled_from(_FILLS.get(dtype, (0, -1, 0.5)))),
    }


@st.composite
def verb_cases(draw, space=None) -> dict:
    """The verbs on tensors of rank 2-5 under the implementation's own layout, a repositioned one or a THD one."""
    space = as_space(space)
    n = draw(world_sizes(space))
    dtype = draw(payload_dtypes(space))
    layout = draw(st.sampled_from(("strategy", "strategy", "repositioned", "thd", "packed")))
    case = with_payload(
        {
            "check": "sharder_verbs",
            "world_size": n,
            "seed": draw(seeds),
            "model": draw(st.sampled_from(("inkling2", "mistral_large4"))),
            "layout": layout,
            "rows": draw(st.integers(1, 3)),
        },
        dtype,
    )
    if layout == "thd":
        case["seq_len"] = 2 * n * draw(st.integers(1, 3))
    elif layout == "packed":  # mistral_large4's packed hook (a repositioned layout where the strategy re-pads)
        spec = draw(packed_layout(max_len=13, rows=case["rows"]))
        case.update(model="mistral_large4", batch=spec, seq_len=spec["seq_len"])
    else:
        case["seq_len"] = draw(st.integers(1, 13))
    if layout == "repositioned":
        case["docs"] = draw(
            st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=case["rows"], max_size=case["rows"])
        )
        case["align"], case["tail"] = draw(st.integers(1, 4)), draw(st.integers(0, 2))
    case["forms"] = draw(st.lists(_form(layout, dtype), min_size=1, max_size=3))
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return draw(with_impl(case, space))


@st.composite
def packer_cases(draw, space=None) -> dict:
    """The verbs on one THD pack laid out as the framework's THD packer emits it for CP size ``N``
    (nemo-automodel's ``packed_sequence.pack_dataset`` / ``_pad_pack``: every document padded to a multiple of
    ``2N``, its ``cp_divisibility_factor``; the pack's own padding, a multiple of ``2N`` here, in the last document's
    span; position ids restarting at each document), one pack a micro-batch (``rows`` 1), through the
    implementation's packed hook; and the sharded batch's ``input_ids`` judged against what its index map names
    (``tokens_held``). Strategies that need the packer's alignment (TE's THD partition) are judged on these."""
    space = as_space(space)
    n = draw(world_sizes(space))
    dtype = draw(payload_dtypes(space))
    factor = 2 * n
    reals = draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))
    padded = [-(-real // factor) * factor for real in reals]
    padded[-1] += factor * draw(st.integers(0, 1))
    seq_len = sum(padded)
    spec = {"format": "thd", "seq_len": seq_len, "docs": [[[r, p] for r, p in zip(reals, padded)]]}
    case = with_payload(
        {
            "check": "sharder_verbs",
            "world_size": n,
            "seed": draw(seeds),
            "model": "mistral_large4",
            "layout": "packed",
            "rows": 1,
            "seq_len": seq_len,
            "batch": {**spec, "given_positions": True},
            "tokens_held": True,
        },
        dtype,
    )
    case["forms"] = draw(st.lists(_form("packed", dtype), min_size=1, max_size=3))
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return draw(with_impl(case, space))


def _example(n: int, seed: int, layout: str, dtype: str, forms: list[dict], **keys) -> dict:
    case = {
        "check": "sharder_verbs",
        "world_size": n,
        "seed": seed,
        "model": "mistral_large4",
        "layout": layout,
        "rows": 2,
        "seq_len": 5,
        **keys,
        "forms": forms,
    }
    return with_payload(case, dtype)


# The check's named examples are case descriptions: one entry a line, read as a table (the formatter would give
# each field a line of its own).
# fmt: off
EXAMPLES = {
    # mRoPE positions [3, B, S] (seq_dim=2) of a length not a multiple of 2N, padded with -1, trimmed back.
    "mrope-int64-n3": _example(3, 11, "strategy", "int64", [
        {"lead": [3], "trail": [], "coords": "caller", "fill": -1, "trim": True},
        {"lead": [], "trail": [], "coords": "nofill", "fill": 0, "trim": True}]),
    # hidden states [B, S, H] and logits [B, S_pad, V] in bfloat16, forward and backward.
    "hidden-bf16-n2": _example(2, 12, "strategy", "bfloat16", [
        {"lead": [], "trail": [4], "coords": "caller", "fill": 0.5, "trim": True},
        {"lead": [], "trail": [3], "coords": "padded", "fill": 0, "trim": False}], model="inkling2"),
    # a bool mask on the packed re-pad: documents moved to aligned columns, dropped slots refilled on trim.
    "repositioned-bool-n2": _example(2, 13, "repositioned", "bool", [
        {"lead": [], "trail": [], "coords": "caller", "fill": 1, "trim": True}],
        docs=[[3, 2], [1]], align=4, tail=1),
    # packed rows through the packed hook: a [B, S] tensor in the caller's coordinates, and mRoPE-shaped padded ones.
    "packed-float64-n2": _example(2, 15, "packed", "float64", [
        {"lead": [], "trail": [], "coords": "caller", "fill": -1, "trim": True},
        {"lead": [3], "trail": [], "coords": "padded", "fill": 0, "trim": False}],
        seq_len=7, batch={"format": "thd", "seq_len": 7, "docs": [[[3, 3], [2, 4]], [[5, 5]]]}),
    # THD rows [B, S, H] flattened, a per-row head-tail partition reported by the layout.
    "thd-float32-n2": _example(2, 14, "thd", "float32", [
        {"lead": [], "trail": [2, 2], "coords": "caller", "fill": -1, "trim": True},
        {"lead": [2], "trail": [], "coords": "padded", "fill": 0, "trim": False}], seq_len=8),
}
# fmt: on

_VERBS = (
    "sharder.shard",
    "sharder.shard_token_tensor",
    "sharder.gather_token_tensor",
    "sharder.local_token_global_indices",
)
SHARDER_VERBS = register(
    "sharder_verbs",
    rank=_rank,
    evaluate=_evaluate,
    functions=_VERBS,
    rows=(
        VerifyRow(
            "sharder verbs: every ShardLayout field, rank 2-5, seq_dim 1/2",
            verb_cases,
            _VERBS,
            PAYLOADS,
            explicit=tuple(EXAMPLES.values()),
            position=7.2,
            id="sharder_verbs",
        ),
        VerifyRow(
            "sharder verbs: THD packs, documents padded to 2N",
            packer_cases,
            _VERBS,
            PAYLOADS,
            position=7.25,
            id="thd_packer_verbs",
        ),
    ),
    examples=EXAMPLES,
    gate_share=1.0,
    repro=Repro(plan=lambda request: sharding.verbs(request, form_value, form_fill)),
)
