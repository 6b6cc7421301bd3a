"""The catalogue of malformed inputs: every documented function, every way its input can be wrong.

Each entry is data (see ``docs/reliability.md``): the function under test, a
*base* input (a valid call, built deterministically on every rank), a list of
*mutations* that break it (named operations with JSON parameters, some only on
chosen CP ranks), the exception types that are acceptable and the field names
of which the message must contain at least one (the entries:
``cp_harness.cases.malformed_catalogue``). ``checks.malformed.case_for(entry, n)``
turns an entry into a case description, so a failing entry travels, prints
and reproduces as JSON like every other case.

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
import time
from collections.abc import Callable
from typing import Any

import torch

from cp_harness.cases.descriptions import IGNORE_INDEX, batches_equal, build_batch, clone_batch

TIME_LIMIT_S = 10.0
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "uint8": torch.uint8,
}

# ------------------------------------------------------------------------------------------- bases
INKLING2_THD = {"format": "thd", "seq_len": 12, "docs": [[[3, 4], [2, 2], [1, 3]], [[5, 6]]]}
INKLING2_BSHD = {"format": "bshd", "seq_len": 9, "rows": [[2, 5], [0, 9], [3, 6]], "images": [[1, 2, 2, 4]]}
MISTRAL_BSHD = {
    "format": "bshd",
    "seq_len": 9,
    "rows": [[2, 5], [0, 9], [3, 6]],
    "images": {"height": 2, "width": 4, "spans": [[1, 0, 2]]},
}
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
            keep[b, start : start + real] = True
            pos[b, start : start + padded] = torch.arange(padded)
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
    "mistral_bshd": lambda s, r, m: {
        "batch": _batch("mistral_large4", MISTRAL_BSHD, s),
        "num_chunks": 1,
        "shard_primary": True,
    },
    "mistral_thd": lambda s, r, m: {
        "batch": _batch("mistral_large4", MISTRAL_THD, s),
        "num_chunks": 2,
        "shard_primary": True,
    },
    "positions": lambda s, r, m: dict(zip(("keep", "positions"), _thd_positions(INKLING2_THD))),
    "sequence_shard": lambda s, r, m: {
        "value": _local(s, r, (2, 3, 4)).requires_grad_(True),
        "mesh": m,
        "differentiable": True,
    },
    "token_shard": lambda s, r, m: {
        "value": _local(s, r, (3, 4)).requires_grad_(True),
        "mesh": m,
        "differentiable": True,
    },
    "history_shard": lambda s, r, m: {"masked": _local(s, r, (2, 3, 4)).requires_grad_(True), "mesh": m, "width": 3},
    "loss_shard": lambda s, r, m: {**_loss_inputs(s, r), "mesh": m},
}

# --------------------------------------------------------------------------------------- functions


def _shard_with_mesh(impl, a):
    """Prepare (outside the timed call), then run the returned strategy ``shard_batch(cp_mesh, tp_mesh, batch)``
    with ``mesh`` as its CP mesh, and enter the context it returns: the strategy's mesh check (the framework hands
    it the 1-D ``"cp"`` sub-mesh)."""
    sharder = a.pop("_sharder")
    ctx_factory, local, layout = sharder.shard_batch(a["mesh"], None, a["batch"])
    with ctx_factory():  # as the framework's train step uses it: a context_parallel context checks its mesh here
        return ctx_factory, local, layout


def _prepare_sharder(impl, a):
    a["_sharder"] = impl.inkling2.prepare_cp_inputs(a["batch"], num_chunks=1)["cp_sharder"]


# name -> (setup run before the snapshot or None, the call)
FUNCTIONS: dict[str, tuple[Callable | None, Callable[[Any, dict], Any]]] = {
    "inkling2.unpack_row_layout": (None, lambda impl, a: impl.inkling2.unpack_row_layout(a["batch"])),
    "inkling2.prepare_cp_inputs": (
        None,
        lambda impl, a: impl.inkling2.prepare_cp_inputs(a["batch"], num_chunks=a["num_chunks"]),
    ),
    "inkling2.validate_document_positions": (
        None,
        lambda impl, a: impl.inkling2.validate_document_positions(a["keep"], a["positions"]),
    ),
    "inkling2.gather_sequence": (
        None,
        lambda impl, a: impl.inkling2.gather_sequence(a["value"], a["mesh"], a["differentiable"]),
    ),
    "inkling2.convolution_history": (
        None,
        lambda impl, a: impl.inkling2.convolution_history(a["masked"], a["mesh"], a["width"]),
    ),
    "mistral_large4.prepare_cp_inputs": (
        None,
        lambda impl, a: impl.mistral_large4.prepare_cp_inputs(
            a["batch"], num_chunks=a["num_chunks"], shard_primary=a["shard_primary"]
        ),
    ),
    "mistral_large4.prepare_packed_cp_inputs": (
        None,
        lambda impl, a: impl.mistral_large4.prepare_packed_cp_inputs(a["batch"], a["num_chunks"], a["shard_primary"]),
    ),
    "mistral_large4.gather_tokens": (
        None,
        lambda impl, a: impl.mistral_large4.gather_tokens(a["value"], a["mesh"], a["differentiable"]),
    ),
    "mistral_large4.shifted_cp_loss": (
        None,
        lambda impl, a: impl.mistral_large4.shifted_cp_loss(a["logits"], a["labels"], a["valid"], a["mesh"]),
    ),
    "sharder.shard_batch": (_prepare_sharder, _shard_with_mesh),
}

# --------------------------------------------------------------------------------------- mutations


def _get(inputs: dict, key: str):
    if key.startswith("batch."):
        return inputs["batch"], key[len("batch.") :]
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
    for value in list(inputs.values()) + list(
        inputs.get("batch", {}).values() if isinstance(inputs.get("batch"), dict) else []
    ):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _mutate(inputs: dict, m: dict, *, rank: int, cp_size: int, mesh_factory: Callable[[str], Any] | None) -> None:
    ranks = m.get("ranks")
    if ranks is not None and rank not in [r % cp_size for r in ranks]:
        return
    op, key = m["op"], m.get("key", "")  # every op but "mesh" names its key
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


def build_inputs(
    case: dict,
    *,
    rank: int,
    cp_size: int,
    mesh: Any,
    mesh_factory: Callable[[str], Any] | None = None,
    device: torch.device | str | None = None,
) -> dict:
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
    snap: dict[str, tuple[str, Any, Any, dict | None]] = {}
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
        if name not in inputs or inputs[name] is not obj:
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
            elif isinstance(saved[key], torch.Tensor) or (
                isinstance(saved[key], list) and all(isinstance(v, torch.Tensor) for v in saved[key])
            ):
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
                problems.append(
                    f"{where}: the unmodified base input must be accepted, got {acc['error_type']}: {acc['message']}"
                )
            continue
        if not acc["raised"]:
            problems.append(
                f"{where} accepted the malformed input ({case['why']}); expected "
                f"{' or '.join(case['errors'])} naming {' or '.join(case['fields'])}"
            )
            continue
        if not set(acc["error_types"]) & set(case["errors"]):
            problems.append(
                f"{where} raised {acc['error_type']}, expected {' or '.join(case['errors'])}: {acc['message']}"
            )
        elif not any(field in (acc["message"] or "") for field in case["fields"]):
            problems.append(
                f"{where}: the {acc['error_type']} does not name the field "
                f"({' or '.join(case['fields'])}): {acc['message']!r}"
            )
        if not acc["unchanged"]:
            problems.append(
                f"{where}: the caller's input changed although the call failed: " + "; ".join(acc["changes"])
            )
    return problems
