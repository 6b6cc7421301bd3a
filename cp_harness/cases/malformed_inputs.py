"""The catalogue of malformed inputs: every documented function, every way its input can be wrong.

Each entry is data (see ``docs/reliability.md``): the function under test, a
*base* input (a valid call, built deterministically on every rank), a list of
*mutations* that break it (named operations with JSON parameters, some only on
chosen CP ranks), the exception types that are acceptable and the field names
of which the message must contain at least one. ``Malformed.case(n)`` turns an
entry into a case description for the ``malformed`` check
(``cp_harness.checks.malformed``), so a failing entry travels, prints and
reproduces as JSON like every other case.

The contract for every entry: on every rank of a real process group, within
``TIME_LIMIT_S`` seconds, the function raises one of ``errors`` whose message
names one of ``fields``; the caller's batch (every input tensor) is unchanged
afterwards, and the pool still runs the next case. ``control=True`` builds the
base input without the mutations: that call must succeed (it proves the base
is valid, so the error comes from the mutation, and that no rank is left
inside a collective).

Mutations (``op``, parameters; ``key`` is an input name, ``batch.<name>`` a
batch key; ``ranks`` restricts a mutation to those CP ranks, negative counting
from the last):

- ``set``: ``key[index] = value`` on a copy of the tensor (``index``: list of ints).
- ``assign``: ``key = value`` (a JSON value).
- ``tensor``: ``key = torch.full(shape, fill, dtype)``, ``arange`` (``torch.arange(shape[-1]) + offset``
  broadcast to ``shape``) or ``torch.tensor(value, dtype)``.
- ``dtype``: ``key = key.to(dtype)``; ``reshape``: ``key = key.reshape(shape)``;
  ``narrow``: drop the last ``drop`` entries of dimension ``dim``.
- ``delete``: remove ``key``; ``tolist``: ``key = key.tolist()``.
- ``mesh``: replace the ``mesh`` input: ``"2d"`` (a real ``(1, N)`` DeviceMesh
  with dims ``("dp", "cp")``: the world mesh passed where its ``["cp"]``
  sub-mesh belongs) or ``"string"`` (``"cp"``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import zlib
from typing import Any, Callable

import torch

from cp_harness.cases.descriptions import IGNORE_INDEX, batches_equal, build_batch, clone_batch

TIME_LIMIT_S = 10.0
BOTH = ("ValueError", "TypeError")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
           "bool": torch.bool, "uint8": torch.uint8}

# ------------------------------------------------------------------------------------------- bases
INKLING2_THD = {"format": "thd", "seq_len": 12, "docs": [[[3, 4], [2, 2], [1, 3]], [[5, 6]]]}
INKLING2_BSHD = {"format": "bshd", "seq_len": 9, "rows": [[2, 5], [0, 9], [3, 6]], "images": [[1, 2, 2, 4]]}
MISTRAL_BSHD = {"format": "bshd", "seq_len": 9, "rows": [[2, 5], [0, 9], [3, 6]],
                "images": {"height": 2, "width": 4, "spans": [[1, 0, 2]]}}
MISTRAL_THD = {"format": "thd", "seq_len": 10, "docs": [[[3, 4], [4, 4]], [[6, 8]]]}


def _batch(model: str, spec: dict, seed: int) -> dict:
    return build_batch({"seed": seed, "model": model, "dtype": "float64", "batch": spec})


def _thd_positions(spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, positions)`` of a THD description (positions restart at each document)."""
    S = spec["seq_len"]
    keep = torch.zeros(len(spec["docs"]), S, dtype=torch.bool)
    pos = torch.zeros(len(spec["docs"]), S, dtype=torch.int64)
    for b, row in enumerate(spec["docs"]):
        start = 0
        for real, padded in row:
            keep[b, start:start + real] = True
            pos[b, start:start + padded] = torch.arange(padded)
            start += padded
    return keep, pos


def _local(seed: int, rank: int, shape: tuple[int, ...], dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _loss_inputs(seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    logits = (5.0 * torch.tanh(torch.randn(2, 3, 5, generator=g) / 5.0)).requires_grad_(True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    labels[1, 2] = IGNORE_INDEX
    valid = torch.ones(6, dtype=torch.bool)
    valid[5] = False
    return {"logits": logits, "labels": labels, "valid": valid}


# name -> builder(seed, rank, mesh) -> inputs (named as the function's parameters)
BASES: dict[str, Callable[[int, int, Any], dict]] = {
    "inkling2_thd": lambda s, r, m: {"batch": _batch("inkling2", INKLING2_THD, s), "num_chunks": 1},
    "inkling2_bshd": lambda s, r, m: {"batch": _batch("inkling2", INKLING2_BSHD, s), "num_chunks": 1},
    "inkling2_bshd_mesh": lambda s, r, m: {"batch": _batch("inkling2", INKLING2_BSHD, s), "mesh": m},
    "mistral_bshd": lambda s, r, m: {"batch": _batch("mistral_large4", MISTRAL_BSHD, s), "num_chunks": 1,
                                     "shard_primary": True},
    "mistral_thd": lambda s, r, m: {"batch": _batch("mistral_large4", MISTRAL_THD, s), "num_chunks": 2,
                                    "shard_primary": True},
    "positions": lambda s, r, m: dict(zip(("keep", "positions"), _thd_positions(INKLING2_THD))),
    "sequence_shard": lambda s, r, m: {"value": _local(s, r, (2, 3, 4)).requires_grad_(True), "mesh": m,
                                       "differentiable": True},
    "token_shard": lambda s, r, m: {"value": _local(s, r, (3, 4)).requires_grad_(True), "mesh": m,
                                    "differentiable": True},
    "history_shard": lambda s, r, m: {"masked": _local(s, r, (2, 3, 4)).requires_grad_(True), "mesh": m,
                                      "width": 3},
    "loss_shard": lambda s, r, m: {**_loss_inputs(s, r), "mesh": m},
}

# --------------------------------------------------------------------------------------- functions


def _shard_with_mesh(impl, a):
    """Prepare (outside the timed call), then run the returned strategy ``shard_batch(cp_mesh, tp_mesh, batch)``
    with ``mesh`` as its CP mesh: the strategy's mesh check (the framework hands it the 1-D ``"cp"`` sub-mesh)."""
    sharder = a.pop("_sharder")
    return sharder.shard_batch(a["mesh"], None, a["batch"])


def _prepare_sharder(impl, a):
    a["_sharder"] = impl.inkling2.prepare_cp_inputs(a["batch"], num_chunks=1)["cp_sharder"]


# name -> (setup run before the snapshot or None, the call)
FUNCTIONS: dict[str, tuple[Callable | None, Callable[[Any, dict], Any]]] = {
    "inkling2.unpack_row_layout": (None, lambda impl, a: impl.inkling2.unpack_row_layout(a["batch"])),
    "inkling2.prepare_cp_inputs": (None, lambda impl, a: impl.inkling2.prepare_cp_inputs(
        a["batch"], num_chunks=a["num_chunks"])),
    "inkling2.validate_document_positions": (None, lambda impl, a: impl.inkling2.validate_document_positions(
        a["keep"], a["positions"])),
    "inkling2.gather_sequence": (None, lambda impl, a: impl.inkling2.gather_sequence(
        a["value"], a["mesh"], a["differentiable"])),
    "inkling2.convolution_history": (None, lambda impl, a: impl.inkling2.convolution_history(
        a["masked"], a["mesh"], a["width"])),
    "mistral_large4.prepare_cp_inputs": (None, lambda impl, a: impl.mistral_large4.prepare_cp_inputs(
        a["batch"], num_chunks=a["num_chunks"], shard_primary=a["shard_primary"])),
    "mistral_large4.prepare_packed_cp_inputs": (None, lambda impl, a: impl.mistral_large4.prepare_packed_cp_inputs(
        a["batch"], a["num_chunks"], a["shard_primary"])),
    "mistral_large4.gather_tokens": (None, lambda impl, a: impl.mistral_large4.gather_tokens(
        a["value"], a["mesh"], a["differentiable"])),
    "mistral_large4.shifted_cp_loss": (None, lambda impl, a: impl.mistral_large4.shifted_cp_loss(
        a["logits"], a["labels"], a["valid"], a["mesh"])),
    "sharder.shard_batch": (_prepare_sharder, _shard_with_mesh),
}

# --------------------------------------------------------------------------------------- mutations


def _get(inputs: dict, key: str):
    if key.startswith("batch."):
        return inputs["batch"], key[len("batch."):]
    return inputs, key


def _put(inputs: dict, key: str, value) -> None:
    holder, name = _get(inputs, key)
    holder[name] = value


def _value(inputs: dict, key: str):
    holder, name = _get(inputs, key)
    return holder[name]


def _like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` (a changed copy of ``old``) requiring a gradient when ``old`` did, so only the intended thing differs."""
    return new.requires_grad_(True) if old.requires_grad and new.is_floating_point() else new


def _device_of(inputs: dict) -> torch.device:
    """Where the inputs live (new tensors made by a mutation go there too)."""
    for value in list(inputs.values()) + list(inputs.get("batch", {}).values() if isinstance(inputs.get("batch"), dict) else []):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _mutate(inputs: dict, m: dict, *, rank: int, cp_size: int, mesh_factory: Callable[[str], Any] | None) -> None:
    ranks = m.get("ranks")
    if ranks is not None and rank not in [r % cp_size for r in ranks]:
        return
    op, key = m["op"], m.get("key")
    device = _device_of(inputs)
    if op == "set":
        old = _value(inputs, key)
        value = old.detach().clone()
        value[tuple(m["index"])] = m["value"]
        _put(inputs, key, _like(value, old))
    elif op == "assign":
        _put(inputs, key, copy.deepcopy(m["value"]))
    elif op == "tensor":
        dtype = _DTYPES[m.get("dtype", "int64")]
        if "value" in m:
            value = torch.tensor(m["value"], dtype=dtype)
        elif m.get("arange"):
            shape = list(m["shape"])
            value = (torch.arange(shape[-1]) + int(m.get("offset", 0))).expand(*shape).to(dtype).clone()
        else:
            value = torch.full(list(m["shape"]), m.get("fill", 0), dtype=dtype)
        _put(inputs, key, value.to(device))
    elif op == "dtype":
        old = _value(inputs, key)
        _put(inputs, key, _like(old.detach().to(_DTYPES[m["dtype"]]), old))
    elif op == "reshape":
        old = _value(inputs, key)
        _put(inputs, key, _like(old.detach().reshape(m["shape"]).clone(), old))
    elif op == "narrow":
        old = _value(inputs, key)
        dim = int(m["dim"])
        _put(inputs, key, _like(old.detach().narrow(dim, 0, old.shape[dim] - int(m.get("drop", 1))).clone(), old))
    elif op == "delete":
        holder, name = _get(inputs, key)
        del holder[name]
    elif op == "tolist":
        _put(inputs, key, _value(inputs, key).tolist())
    elif op == "mesh":
        if m["kind"] == "string":
            inputs["mesh"] = "cp"
        else:
            if mesh_factory is None:
                raise ValueError(f"mutation mesh={m['kind']!r} needs a process group (run it on the rank pool)")
            inputs["mesh"] = mesh_factory(m["kind"])
    else:
        raise ValueError(f"unknown mutation op {op!r}")


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device).requires_grad_(value.requires_grad)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


def build_inputs(case: dict, *, rank: int, cp_size: int, mesh: Any,
                 mesh_factory: Callable[[str], Any] | None = None, device: torch.device | str | None = None) -> dict:
    """The inputs of ``case`` on CP rank ``rank`` (on ``device``): the base, then (unless ``case["control"]``)
    the mutations."""
    inputs = BASES[case["base"]](int(case.get("seed", 0)), rank, mesh)
    if device is not None and torch.device(device).type != "cpu":
        inputs = {k: v if k == "mesh" else _to_device(v, torch.device(device)) for k, v in inputs.items()}
    if not case.get("control"):
        for m in case["mutations"]:
            _mutate(inputs, m, rank=rank, cp_size=cp_size, mesh_factory=mesh_factory)
    return inputs


# ------------------------------------------------------------------------------------------ a call


def snapshot_inputs(inputs: dict) -> dict:
    """What ``input_changes`` needs to tell later whether a call changed its inputs (dicts and tensors)."""
    snap = {}
    for name, value in inputs.items():
        if isinstance(value, dict):
            snap[name] = ("dict", value, clone_batch(value), dict(value))
        elif isinstance(value, torch.Tensor):
            snap[name] = ("tensor", value, value.detach().clone(), None)
    return snap


def input_changes(inputs: dict, snap: dict) -> list[str]:
    """What a call changed in the caller's inputs since ``snapshot_inputs`` (empty when nothing).

    A dict (the batch) must keep its keys, the very same objects under them and their values; a
    tensor argument its dtype, shape and values.
    """
    out = []
    for name, (kind, obj, saved, shallow) in snap.items():
        if inputs.get(name) is not obj:
            out.append(f"{name} was replaced")
            continue
        if kind == "tensor":
            if obj.dtype != saved.dtype or obj.shape != saved.shape or not torch.equal(obj.detach(), saved):
                out.append(f"{name} was modified in place")
            continue
        if set(obj) != set(saved):
            out.append(f"{name}: keys added {sorted(set(obj) - set(saved))}, removed {sorted(set(saved) - set(obj))}")
            continue
        for key in saved:
            if obj[key] is not shallow[key]:
                out.append(f"{name}[{key!r}] was replaced by another object")
            elif isinstance(saved[key], torch.Tensor) or (isinstance(saved[key], list) and all(
                    isinstance(v, torch.Tensor) for v in saved[key])):
                diff = batches_equal({key: obj[key]}, {key: saved[key]})
                if diff:
                    out.append(f"{name}: {diff}")
            elif obj[key] != saved[key]:
                out.append(f"{name}[{key!r}] changed")
    return out


def attempt(function: str, impl: Any, inputs: dict) -> dict:
    """Call ``function`` of ``impl`` on ``inputs``; never raises for an ``Exception`` of the call.

    Returns a JSON-able account: ``raised``, ``error_type``, ``error_types``
    (the exception's class hierarchy, so subclasses of ``ValueError`` count),
    ``message``, ``seconds`` (of the call alone), ``unchanged`` and ``changes``
    (the caller's inputs after the call).
    """
    setup, call = FUNCTIONS[function]
    if setup is not None:
        setup(impl, inputs)
    snap = snapshot_inputs(inputs)
    started = time.perf_counter()
    error: Exception | None = None
    try:
        call(impl, inputs)
    except Exception as exc:  # noqa: BLE001 - every error is reported and judged, none escapes
        error = exc
    seconds = time.perf_counter() - started
    changes = input_changes(inputs, snap)
    return {
        "raised": error is not None,
        "error_type": type(error).__name__ if error is not None else None,
        "error_types": [c.__name__ for c in type(error).__mro__] if error is not None else [],
        "message": str(error)[:4000] if error is not None else None,
        "seconds": seconds,
        "unchanged": not changes,
        "changes": changes,
    }


def judge(case: dict, accounts: list[dict]) -> list[str]:
    """Problems with the per-rank accounts of a malformed (or control) case; empty when it behaved."""
    problems = []
    control = bool(case.get("control"))
    for rank, acc in enumerate(accounts):
        where = f"rank {rank}: {case['function']} ({case['name']}{', control' if control else ''})"
        if acc["seconds"] > TIME_LIMIT_S:
            problems.append(f"{where} took {acc['seconds']:.1f} s (limit {TIME_LIMIT_S:.0f} s)")
        if control:
            if acc["raised"]:
                problems.append(f"{where}: the unmodified base input must be accepted, got "
                                f"{acc['error_type']}: {acc['message']}")
            continue
        if not acc["raised"]:
            problems.append(f"{where} accepted the malformed input ({case['why']}); expected "
                            f"{' or '.join(case['errors'])} naming {' or '.join(case['fields'])}")
            continue
        if not set(acc["error_types"]) & set(case["errors"]):
            problems.append(f"{where} raised {acc['error_type']}, expected {' or '.join(case['errors'])}: "
                            f"{acc['message']}")
        elif not any(field in (acc["message"] or "") for field in case["fields"]):
            problems.append(f"{where}: the {acc['error_type']} does not name the field "
                            f"({' or '.join(case['fields'])}): {acc['message']!r}")
        if not acc["unchanged"]:
            problems.append(f"{where}: the caller's input changed although the call failed: "
                            + "; ".join(acc["changes"]))
    return problems


# ---------------------------------------------------------------------------------------- catalogue


@dataclasses.dataclass(frozen=True)
class Malformed:
    """One malformed input: ``function`` called on ``base`` after ``mutations`` (see the module docstring)."""

    name: str
    function: str
    base: str
    mutations: tuple[dict, ...]
    fields: tuple[str, ...]
    why: str
    errors: tuple[str, ...] = ("ValueError",)
    min_world_size: int = 1
    world_size: int | None = None  # fixed size (e.g. the 2 x 2 mesh); else chosen by the suite

    @property
    def rank_dependent(self) -> bool:
        return any("ranks" in m for m in self.mutations)

    @property
    def needs_group(self) -> bool:
        return any(m["op"] == "mesh" and m["kind"] != "string" for m in self.mutations)

    def case(self, world_size: int, *, control: bool = False, seed: int | None = None) -> dict:
        case = {"check": "malformed", "world_size": int(world_size), "name": self.name, "function": self.function,
                "base": self.base, "mutations": [dict(m) for m in self.mutations], "errors": list(self.errors),
                "fields": list(self.fields), "why": self.why,
                "seed": zlib.crc32(self.name.encode()) % 1000 if seed is None else seed}
        if control:
            case["control"] = True
        return case


def _set(key, index, value, **kw):
    return {"op": "set", "key": key, "index": list(index), "value": value, **kw}


def _assign(key, value, **kw):
    return {"op": "assign", "key": key, "value": value, **kw}


def _op(op, key=None, **kw):
    out = {"op": op, **kw}
    if key is not None:
        out["key"] = key
    return out


_M = Malformed
SL, SLP = "batch.seq_lens", "batch.seq_lens_padded"
UNPACK, INK_PREP, VALIDATE = "inkling2.unpack_row_layout", "inkling2.prepare_cp_inputs", "inkling2.validate_document_positions"
GATHER_SEQ, HISTORY = "inkling2.gather_sequence", "inkling2.convolution_history"
M4_PREP, M4_PACKED = "mistral_large4.prepare_cp_inputs", "mistral_large4.prepare_packed_cp_inputs"
GATHER_TOK, LOSS = "mistral_large4.gather_tokens", "mistral_large4.shifted_cp_loss"

CATALOGUE: tuple[Malformed, ...] = (
    # ---- inkling2.unpack_row_layout: THD metadata ------------------------------------------------
    _M("unpack/negative_real_length", UNPACK, "inkling2_thd", (_set(SL, [0, 1], -2),), ("seq_lens",),
       "a negative real length"),
    _M("unpack/negative_padded_length", UNPACK, "inkling2_thd", (_set(SLP, [0, 2], -1),), ("seq_lens_padded",),
       "a negative padded length"),
    _M("unpack/negative_not_filler", UNPACK, "inkling2_thd", (_set(SL, [1, 1], -999), _set(SLP, [1, 1], -999)),
       ("seq_lens",), "a negative length that is not the -1000 filler"),
    _M("unpack/length_after_filler", UNPACK, "inkling2_thd", (_set(SL, [1, 2], 2), _set(SLP, [1, 2], 2)),
       ("seq_lens",), "a real length after the -1000 filler"),
    _M("unpack/filler_in_one_only", UNPACK, "inkling2_thd", (_set(SLP, [1, 1], 3),), ("seq_lens",),
       "the filler in seq_lens but a length in seq_lens_padded"),
    _M("unpack/real_exceeds_padded", UNPACK, "inkling2_thd", (_set(SL, [0, 0], 5),), ("seq_lens",),
       "real length > padded length"),
    _M("unpack/padded_sum_exceeds_sequence", UNPACK, "inkling2_thd", (_set(SLP, [0, 2], 7),), ("seq_lens_padded",),
       "padded lengths summing past the sequence"),
    _M("unpack/padded_sum_overflows_int64", UNPACK, "inkling2_thd",
       (_set(SLP, [0, 0], 2**62), _set(SLP, [0, 1], 2**62)), ("seq_lens_padded",),
       "padded lengths whose int64 sum wraps around to a negative number"),
    _M("unpack/documents_disagree", UNPACK, "inkling2_thd", (_op("narrow", SL, dim=1, drop=1),), ("seq_lens",),
       "seq_lens and seq_lens_padded with different numbers of documents"),
    _M("unpack/lengths_wrong_batch", UNPACK, "inkling2_thd",
       (_op("narrow", SL, dim=0, drop=1), _op("narrow", SLP, dim=0, drop=1)), ("seq_lens",),
       "one row of lengths for a batch of two rows"),
    _M("unpack/lengths_one_dimensional", UNPACK, "inkling2_thd",
       (_op("reshape", SL, shape=[-1]), _op("reshape", SLP, shape=[-1])), ("seq_lens",),
       "1-D lengths instead of [batch, documents]"),
    _M("unpack/lengths_float", UNPACK, "inkling2_thd",
       (_op("dtype", SL, dtype="float32"), _op("dtype", SLP, dtype="float32")), ("seq_lens",),
       "floating-point lengths", errors=BOTH),
    _M("unpack/lengths_not_tensor", UNPACK, "inkling2_thd", (_assign(SL, "3,2,1"),), ("seq_lens",),
       "a string where the lengths tensor belongs", errors=BOTH),
    _M("unpack/missing_seq_lens_padded", UNPACK, "inkling2_thd", (_op("delete", SLP),), ("seq_lens_padded",),
       "seq_lens without seq_lens_padded"),
    _M("unpack/position_ids_disagree", UNPACK, "inkling2_thd",
       (_op("tensor", "batch.position_ids", shape=[2, 12], arange=True),), ("position_ids",),
       "given position_ids that run on across documents (disagree with the pack on real tokens)"),
    _M("unpack/position_ids_float", UNPACK, "inkling2_thd",
       (_op("tensor", "batch.position_ids", shape=[2, 12], arange=True, dtype="float32"),), ("position_ids",),
       "floating-point position_ids", errors=BOTH),
    _M("unpack/position_ids_wrong_shape", UNPACK, "inkling2_thd",
       (_op("tensor", "batch.position_ids", shape=[2, 11], arange=True),), ("position_ids",),
       "position_ids shorter than the sequence"),
    _M("unpack/labels_wrong_shape", UNPACK, "inkling2_thd", (_op("narrow", "batch.labels", dim=1, drop=2),),
       ("labels",), "labels shorter than input_ids"),
    _M("unpack/input_ids_float", UNPACK, "inkling2_thd", (_op("dtype", "batch.input_ids", dtype="float32"),),
       ("input_ids",), "floating-point input_ids", errors=BOTH),
    _M("unpack/batch_not_a_dict", UNPACK, "inkling2_thd", (_assign("batch", [1, 2, 3]),), ("batch",),
       "a list where the batch dict belongs", errors=BOTH),
    # ---- inkling2.validate_document_positions --------------------------------------------------------
    _M("positions/gap_resumes_document", VALIDATE, "positions",
       (_set("positions", [0, 4], 4), _set("positions", [0, 5], 5)), ("positions",),
       "after a gap of padding the count resumes the previous document instead of restarting at 0"),
    _M("positions/negative", VALIDATE, "positions", (_set("positions", [1, 0], -1),), ("positions",),
       "a negative position on a kept token"),
    _M("positions/jump_inside_document", VALIDATE, "positions", (_set("positions", [1, 2], 5),), ("positions",),
       "a position that is neither prev + 1 nor 0"),
    _M("positions/keep_not_bool", VALIDATE, "positions", (_op("dtype", "keep", dtype="int64"),), ("keep",),
       "an integer keep mask", errors=BOTH),
    _M("positions/positions_float", VALIDATE, "positions", (_op("dtype", "positions", dtype="float32"),),
       ("positions",), "floating-point positions", errors=BOTH),
    _M("positions/shapes_differ", VALIDATE, "positions", (_op("narrow", "positions", dim=1, drop=1),),
       ("keep", "positions"), "keep and positions of different shapes"),
    _M("positions/one_dimensional", VALIDATE, "positions",
       (_op("reshape", "keep", shape=[-1]), _op("reshape", "positions", shape=[-1])), ("keep", "positions"),
       "1-D keep and positions instead of [batch, sequence]"),
    # ---- inkling2.prepare_cp_inputs -------------------------------------------------------------------
    _M("inkling2_prepare/num_chunks_not_divisor", INK_PREP, "inkling2_bshd", (_assign("num_chunks", 2),),
       ("num_chunks",), "batch size 3 not divisible by num_chunks=2"),
    _M("inkling2_prepare/num_chunks_zero", INK_PREP, "inkling2_bshd", (_assign("num_chunks", 0),),
       ("num_chunks",), "num_chunks=0"),
    _M("inkling2_prepare/num_chunks_float", INK_PREP, "inkling2_bshd", (_assign("num_chunks", 1.5),),
       ("num_chunks",), "num_chunks=1.5", errors=BOTH),
    _M("inkling2_prepare/attention_mask_value", INK_PREP, "inkling2_bshd",
       (_set("batch.attention_mask", [0, 3], 2),), ("attention_mask",), "an attention_mask entry of 2"),
    _M("inkling2_prepare/attention_mask_float", INK_PREP, "inkling2_bshd",
       (_op("dtype", "batch.attention_mask", dtype="float32"),), ("attention_mask",),
       "a floating-point attention_mask", errors=BOTH),
    _M("inkling2_prepare/attention_mask_hole", INK_PREP, "inkling2_bshd",
       (_set("batch.attention_mask", [1, 4], 0),), ("attention_mask",),
       "padding between real tokens of an unpacked row (the real tokens resume after a gap)"),
    _M("inkling2_prepare/attention_mask_wrong_shape", INK_PREP, "inkling2_bshd",
       (_op("narrow", "batch.attention_mask", dim=1, drop=1),), ("attention_mask",),
       "an attention_mask shorter than the sequence"),
    _M("inkling2_prepare/image_mask_not_bool", INK_PREP, "inkling2_bshd",
       (_op("dtype", "batch.image_mask", dtype="int64"),), ("image_mask",), "an integer image_mask", errors=BOTH),
    _M("inkling2_prepare/image_mask_wrong_shape", INK_PREP, "inkling2_bshd",
       (_op("narrow", "batch.image_mask", dim=0, drop=1),), ("image_mask",), "an image_mask with too few rows"),
    _M("inkling2_prepare/pixel_values_two_dimensional", INK_PREP, "inkling2_bshd",
       (_op("tensor", "batch.pixel_values", shape=[3, 8], fill=0.5, dtype="float64"),), ("pixel_values",),
       "pixel_values that are neither a list of [C, H, W] nor [images, C, H, W]", errors=BOTH),
    _M("inkling2_prepare/position_ids_negative", INK_PREP, "inkling2_bshd",
       (_op("tensor", "batch.position_ids", shape=[3, 9], arange=True, offset=-3),), ("position_ids",),
       "position_ids negative at a real token"),
    _M("inkling2_prepare/position_ids_jump", INK_PREP, "inkling2_bshd",
       (_op("tensor", "batch.position_ids", shape=[3, 9], arange=True), _set("batch.position_ids", [1, 5], 9)),
       ("position_ids",), "position_ids that jump inside a document"),
    _M("inkling2_prepare/no_input_ids", INK_PREP, "inkling2_bshd", (_op("delete", "batch.input_ids"),),
       ("input_ids",), "a batch without input_ids"),
    _M("inkling2_prepare/labels_float", INK_PREP, "inkling2_bshd", (_op("dtype", "batch.labels", dtype="float32"),),
       ("labels",), "floating-point labels", errors=BOTH),
    _M("inkling2_prepare/packed_negative_length", INK_PREP, "inkling2_thd", (_set(SL, [1, 0], -5),),
       ("seq_lens",), "a negative length in a packed batch (prepare goes through unpack_row_layout)"),
    _M("inkling2_prepare/packed_num_chunks_not_divisor", INK_PREP, "inkling2_thd", (_assign("num_chunks", 3),),
       ("num_chunks",), "batch size 2 not divisible by num_chunks=3"),
    # ---- mistral_large4.prepare_cp_inputs / prepare_packed_cp_inputs --------------------------------------
    _M("mistral_prepare/num_chunks_not_divisor", M4_PREP, "mistral_bshd", (_assign("num_chunks", 2),),
       ("num_chunks",), "batch size 3 not divisible by num_chunks=2"),
    _M("mistral_prepare/num_chunks_negative", M4_PREP, "mistral_bshd", (_assign("num_chunks", -1),),
       ("num_chunks",), "num_chunks=-1"),
    _M("mistral_prepare/shard_primary_not_bool", M4_PREP, "mistral_bshd", (_assign("shard_primary", "no"),),
       ("shard_primary",), "shard_primary='no' (a truthy string)", errors=BOTH),
    _M("mistral_prepare/pixel_values_batched", M4_PREP, "mistral_bshd",
       (_op("reshape", "batch.pixel_values", shape=[1, 3, 2, 4]),), ("pixel_values",),
       "a batch of images where one complete [C, H, W] image belongs", errors=BOTH),
    _M("mistral_prepare/ids_and_embeddings", M4_PREP, "mistral_bshd",
       (_op("tensor", "batch.inputs_embeds", shape=[3, 9, 4], fill=0.25, dtype="float32"),),
       ("input_ids", "inputs_embeds"), "both input_ids and inputs_embeds (which one is the input?)"),
    _M("mistral_prepare/embeddings_two_dimensional", M4_PREP, "mistral_bshd",
       (_op("delete", "batch.input_ids"), _op("tensor", "batch.inputs_embeds", shape=[3, 9], fill=0.25,
                                                dtype="float32")),
       ("inputs_embeds",), "inputs_embeds without a hidden dimension", errors=BOTH),
    _M("mistral_prepare/attention_mask_negative", M4_PREP, "mistral_bshd",
       (_set("batch.attention_mask", [2, 5], -1),), ("attention_mask",), "an attention_mask entry of -1"),
    _M("mistral_prepare/packed_negative_length", M4_PREP, "mistral_thd", (_set(SL, [0, 0], -1),),
       ("seq_lens",), "a negative length in a packed batch (dispatched to prepare_packed_cp_inputs)"),
    _M("mistral_packed/batch_size_not_num_chunks", M4_PACKED, "mistral_thd", (_assign("num_chunks", 1),),
       ("num_chunks",), "two packed rows for num_chunks=1 (one packed row per micro-batch)"),
    _M("mistral_packed/real_exceeds_padded", M4_PACKED, "mistral_thd", (_set(SL, [1, 0], 9),), ("seq_lens",),
       "real length > padded length"),
    _M("mistral_packed/padded_sum_exceeds_sequence", M4_PACKED, "mistral_thd", (_set(SLP, [0, 1], 7),),
       ("seq_lens_padded",), "padded lengths summing past the sequence"),
    _M("mistral_packed/no_lengths", M4_PACKED, "mistral_thd", (_op("delete", SL), _op("delete", SLP)),
       ("seq_lens",), "a packed call without seq_lens/seq_lens_padded"),
    # ---- inkling2.gather_sequence ------------------------------------------------------------------------
    _M("gather_sequence/local_length_differs", GATHER_SEQ, "sequence_shard",
       (_op("narrow", "value", dim=1, drop=1, ranks=[1]),), ("value",),
       "local shards of different lengths on different ranks", min_world_size=2),
    _M("gather_sequence/dtype_differs", GATHER_SEQ, "sequence_shard",
       (_op("dtype", "value", dtype="float32", ranks=[0]),), ("value",), "float32 on rank 0, float64 elsewhere",
       min_world_size=2),
    _M("gather_sequence/one_dimensional", GATHER_SEQ, "sequence_shard", (_op("reshape", "value", shape=[-1]),),
       ("value",), "a 1-D value without a sequence dimension"),
    _M("gather_sequence/differentiable_not_bool", GATHER_SEQ, "sequence_shard",
       (_assign("differentiable", "yes"),), ("differentiable",), "differentiable='yes'", errors=BOTH),
    _M("gather_sequence/differentiable_differs", GATHER_SEQ, "sequence_shard",
       (_assign("differentiable", False, ranks=[-1]),), ("differentiable",),
       "differentiable=False on the last rank only (its backward would never join the others')",
       min_world_size=2),
    _M("gather_sequence/mesh_two_dimensional", GATHER_SEQ, "sequence_shard", (_op("mesh", kind="2d"),),
       ("mesh",), "a (dp=1, cp=N) 2-D mesh instead of its 1-D cp sub-mesh", errors=BOTH),
    _M("gather_sequence/mesh_not_a_mesh", GATHER_SEQ, "sequence_shard", (_op("mesh", kind="string"),),
       ("mesh",), "the string 'cp' as mesh", errors=BOTH),
    _M("gather_sequence/value_not_tensor", GATHER_SEQ, "sequence_shard", (_op("tolist", "value"),), ("value",),
       "a nested list instead of a tensor", errors=BOTH),
    # ---- mistral_large4.gather_tokens -----------------------------------------------------------------------
    _M("gather_tokens/token_count_differs", GATHER_TOK, "token_shard",
       (_op("narrow", "value", dim=0, drop=1, ranks=[0]),), ("value",),
       "different local token counts on different ranks", min_world_size=2),
    _M("gather_tokens/features_differ", GATHER_TOK, "token_shard",
       (_op("narrow", "value", dim=1, drop=1, ranks=[-1]),), ("value",),
       "different trailing shapes on different ranks", min_world_size=2),
    _M("gather_tokens/zero_dimensional", GATHER_TOK, "token_shard",
       (_op("tensor", "value", shape=[], fill=1.0, dtype="float64"),), ("value",), "a 0-D value"),
    _M("gather_tokens/mesh_two_dimensional", GATHER_TOK, "token_shard", (_op("mesh", kind="2d"),), ("mesh",),
       "a (dp=1, cp=N) 2-D mesh", errors=BOTH),
    # ---- inkling2.convolution_history -------------------------------------------------------------------------
    _M("convolution_history/width_zero", HISTORY, "history_shard", (_assign("width", 0),), ("width",), "width=0"),
    _M("convolution_history/width_negative", HISTORY, "history_shard", (_assign("width", -2),), ("width",),
       "width=-2"),
    _M("convolution_history/width_float", HISTORY, "history_shard", (_assign("width", 2.0),), ("width",),
       "width=2.0", errors=BOTH),
    _M("convolution_history/width_differs", HISTORY, "history_shard", (_assign("width", 4, ranks=[1]),),
       ("width",), "width 4 on rank 1, 3 elsewhere", min_world_size=2),
    _M("convolution_history/local_length_differs", HISTORY, "history_shard",
       (_op("narrow", "masked", dim=1, drop=1, ranks=[0]),), ("masked",),
       "local shards of different lengths on different ranks", min_world_size=2),
    _M("convolution_history/channels_differ", HISTORY, "history_shard",
       (_op("narrow", "masked", dim=2, drop=1, ranks=[-1]),), ("masked",),
       "different channel counts on different ranks", min_world_size=2),
    _M("convolution_history/two_dimensional", HISTORY, "history_shard", (_op("reshape", "masked", shape=[2, 12]),),
       ("masked",), "a 2-D shard without channels"),
    _M("convolution_history/mesh_two_dimensional", HISTORY, "history_shard", (_op("mesh", kind="2d"),), ("mesh",),
       "a (dp=1, cp=N) 2-D mesh", errors=BOTH),
    # ---- mistral_large4.shifted_cp_loss -------------------------------------------------------------------------
    _M("shifted_cp_loss/labels_wrong_shape", LOSS, "loss_shard", (_op("narrow", "labels", dim=1, drop=1),),
       ("labels",), "labels shorter than the logits"),
    _M("shifted_cp_loss/labels_float", LOSS, "loss_shard", (_op("dtype", "labels", dtype="float32"),), ("labels",),
       "floating-point labels", errors=BOTH),
    _M("shifted_cp_loss/valid_not_bool", LOSS, "loss_shard", (_op("dtype", "valid", dtype="int64"),), ("valid",),
       "an integer valid mask", errors=BOTH),
    _M("shifted_cp_loss/valid_wrong_length", LOSS, "loss_shard", (_op("narrow", "valid", dim=0, drop=1),),
       ("valid",), "valid shorter than batch * local_sequence"),
    _M("shifted_cp_loss/label_out_of_range_one_rank", LOSS, "loss_shard", (_set("labels", [0, 1], 99, ranks=[1]),),
       ("labels",), "a label outside [0, vocab) at a valid position, on rank 1 only", min_world_size=2),
    _M("shifted_cp_loss/logits_integer", LOSS, "loss_shard", (_op("dtype", "logits", dtype="int64"),),
       ("logits",), "integer logits", errors=BOTH),
    _M("shifted_cp_loss/local_length_differs", LOSS, "loss_shard",
       (_op("narrow", "logits", dim=1, drop=1, ranks=[0]), _op("narrow", "labels", dim=1, drop=1, ranks=[0]),
        _op("narrow", "valid", dim=0, drop=2, ranks=[0])), ("logits", "labels", "valid"),
       "shards of different lengths (each consistent in itself) on different ranks", min_world_size=2),
    _M("shifted_cp_loss/vocab_differs", LOSS, "loss_shard", (_op("narrow", "logits", dim=2, drop=1, ranks=[-1]),),
       ("logits",), "a different vocabulary on the last rank", min_world_size=2),
    _M("shifted_cp_loss/mesh_two_dimensional", LOSS, "loss_shard", (_op("mesh", kind="2d"),), ("mesh",),
       "a (dp=1, cp=N) 2-D mesh", errors=BOTH),
    # ---- the sharder -------------------------------------------------------------------------------------------
    _M("sharder/shard_batch_two_dimensional_mesh", "sharder.shard_batch", "inkling2_bshd_mesh",
       (_op("mesh", kind="2d"),), ("mesh",), "shard_batch given a (dp=1, cp=N) 2-D mesh as its CP mesh", errors=BOTH),
)

BY_NAME: dict[str, Malformed] = {m.name: m for m in CATALOGUE}
if len(BY_NAME) != len(CATALOGUE):  # pragma: no cover - a catalogue edit error
    raise RuntimeError("cp_harness.cases.malformed_inputs: duplicate entry names")


def world_size_for(entry: Malformed, index: int, available: tuple[int, ...], preferred=(2, 3, 4)) -> int | None:
    """The CP size an entry runs at: its fixed size, else ``preferred`` in turn, within ``available``.

    ``None`` when no available size is large enough.
    """
    usable = sorted(s for s in available if s >= max(entry.min_world_size, 2)) or \
        sorted(s for s in available if s >= entry.min_world_size)
    if entry.world_size is not None:
        return entry.world_size if entry.world_size <= max(available) else None
    if not usable:
        return None
    want = preferred[index % len(preferred)]
    fits = [s for s in usable if s >= want]
    return fits[0] if fits else usable[-1]
