"""Scripts of a hook and its sharder: what every rank's local batch holds, at the index map the sharder reports.

Every rank builds the case's global batch, calls the hook under test (or, for an adapter, the framework's
sharder on the batch as the adapter's hook leaves it), resolves the sharder the framework's way and shards
inside its context, as a train step does; rank 0 then judges what every rank reported:

* the caller's tensors are unchanged (``shard()`` may replace dict entries, never resize or overwrite a tensor);
* the index maps partition the padded sequence and agree with what ``shard_token_tensor`` cuts (else both are
  printed: the index map reported, and the one the local tensors follow);
* each judged key of the local batch, put back at its global positions, is the oracle's layout, with the
  contract's value at divisibility padding (``Key.padding``);
* where they failed: ``unpack_row_layout`` called directly, and the token verbs on the case's tensors.

The expected arrays are the check's (``ShardCase``); the script computes the padded expectation from the index
map it is given, so a correct sharder of any padding rule or index map passes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import numpy as np
import torch

from cp_harness.cases.descriptions import build_batch
from cp_harness.judging.verdicts import ProblemKind
from cp_harness.repro import script
from cp_harness.repro.script import NotExportable
from cp_harness.repro.subjects import Subject, inline

# Placeholders of the script's constants (script.py writes each script's own).
S, UNPACK, WORLD = 0, False, 1
HOOK: tuple[str, str, dict[str, Any]] = ("", "", {})
KEYS: dict[str, list[Any]] = {}
BATCH_TEXT: dict[str, Any] = {}
FORMS: list[dict[str, Any]] = []


@dataclasses.dataclass(frozen=True)
class Key:
    """A key of the local batch and what it must hold: ``padding``: its value at divisibility padding
    (``"count"``: positions counting on from the last slot; ``"free"``: not compared there; ``"global"``: the key
    stays global, every rank holds the caller's tensor); ``dtype``: the dtype it must keep (``None``: any)."""

    name: str
    padding: Any
    dtype: str | None = None


@dataclasses.dataclass
class ShardCase:
    """What a sharding script runs: ``hook`` = (model part, hook name, keyword arguments) on ``batch`` (the
    global batch, every rank the same; ``hooked``: as the adapter's hook leaves it, for an adapter's sharder);
    ``loss_mask`` for the sharder's constructor; ``keys`` judged against ``expected`` (``[B, S]`` each) on the
    positions of ``compared`` (``[B, S]`` bool); ``unpack``: the expected ``(padding_mask, position_ids, keep)``
    of ``unpack_row_layout`` called directly; ``forms``: token verb calls (``value``, ``seq_dim``, ``fill``,
    ``trim``, per rank ``upstream``); ``what``: what the contract says of them."""

    world: int
    hook: tuple[str, str, dict]
    batch: dict[str, Any]
    keys: list[Key]
    expected: dict[str, torch.Tensor]
    compared: dict[str, torch.Tensor]
    what: str
    mesh: bool = True
    hooked: dict[str, Any] | None = None
    loss_mask: torch.Tensor | None = None
    unpack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    forms: list[dict] = dataclasses.field(default_factory=list)


def _add_batch(p: script.Plan, prefix: str, batch: dict) -> dict:
    text = {}
    for key, value in batch.items():
        if isinstance(value, list):
            for i, item in enumerate(value):
                p.add(f"{prefix}/{key}/{i}", item)
        elif isinstance(value, torch.Tensor):
            p.add(f"{prefix}/{key}", value)
        else:
            text[key] = value
    return text


def marked(batch: dict) -> dict:
    """``batch`` with every row's labels replaced by ``arange(S)``: sharded, they say where each local token is from."""
    labels = batch["labels"]
    return {**batch, "labels": torch.arange(labels.shape[1], dtype=labels.dtype).expand_as(labels).clone()}


def adapter_sharder(subject: Subject, sharder) -> tuple[list[str], list[str], str]:
    """``(imports, source blocks, constructor)`` of an adapter's unresolved sharder, copied from the adapter: its
    class and its two strategy functions, as the adapter's hook builds it."""
    (strategy, bound), (indices, _) = _named(sharder.shard_batch), _named(sharder.local_token_global_indices)
    names = [type(sharder).__name__, strategy, indices]
    if any(n == "<lambda>" or "." in n for n in names):
        raise NotExportable(f"the sharder of {subject.module} is not built from module-level definitions ({names})")
    imports, blocks = inline(subject.module, names)
    if bound != strategy:
        imports = [*imports, "import functools"]
    return imports, blocks, f"{names[0]}(shard_batch={bound}, local_token_global_indices={indices})"


def _copyable(subject: Subject, sharder) -> bool:
    try:
        adapter_sharder(subject, sharder)
    except NotExportable:
        return False
    return True


def _named(fn) -> tuple[str, str]:
    """``(name of the definition, the expression the script builds it with)``: a ``functools.partial`` of a
    module-level function with literal keywords is rebuilt as one."""
    if isinstance(fn, functools.partial):
        if fn.args or not all(isinstance(v, (bool, int, float, str, type(None))) for v in fn.keywords.values()):
            raise NotExportable(f"a sharder strategy bound as {fn!r} (only literal keywords are written into a script)")
        name = getattr(fn.func, "__name__", "<lambda>")
        return name, f"functools.partial({name}, " + ", ".join(f"{k}={v!r}" for k, v in fn.keywords.items()) + ")"
    name = getattr(fn, "__name__", "<lambda>")
    return name, name


def plan(case: ShardCase, subject: Subject, name: str, case_text: str, sharder=None) -> script.Plan:
    """The script of ``case`` against ``subject`` (``sharder``: an adapter's unresolved sharder, copied in)."""
    imports, blocks, constructor = adapter_sharder(subject, sharder) if subject.inlined else ([], [], "")
    parts = [p for p, on in (("the caller's tensors", True), ("the index maps", True),
                             ("the local " + ", ".join(k.name for k in case.keys), case.keys),
                             ("unpack_row_layout called directly", case.unpack is not None),
                             ("the token verbs", case.forms)) if on]
    doc = [f"Repro: {subject.title('.'.join(case.hook[:2]))} and its sharder at CP size {case.world}.",
           f"What it checks: {case.what} Every rank builds the case's global batch, calls "
           f"{'.'.join(case.hook[:2])}({', '.join(['batch', *(f'{k}={v!r}' for k, v in case.hook[2].items())])}), "
           "resolves the sharder it returns the framework's way and shards inside its context, as a train step "
           f"does; rank 0 judges {', '.join(parts)} (bit for bit) and prints what differs, with the rank, the "
           "global position and both values.", *subject.run_paragraphs(), f"Exported by cp_harness from the case "
           f"{case_text}."]
    p = script.Plan(name=name, doc=doc, world=case.world, mesh=case.mesh, imports=imports)
    text = _add_batch(p, "batch", case.batch)
    if case.keys:
        _add_batch(p, "marked", marked(case.batch))
    if case.hooked is not None:
        _add_batch(p, "hooked", case.hooked)
        if case.keys:
            _add_batch(p, "marked_hooked", marked(case.hooked))
    if case.loss_mask is not None:
        p.add("loss_mask", case.loss_mask)
    for key in case.keys:
        p.add(f"expected/{key.name}", case.expected[key.name])
        p.add(f"compared/{key.name}", case.compared[key.name])
    if case.unpack is not None:
        for label, value in zip(("padding_mask", "position_ids", "keep"), case.unpack):
            p.add(f"unpack/{label}", value)
    for i, form in enumerate(case.forms):
        p.add(f"form{i}/value", form["value"])
    p.constants.update(S=int(case.batch["input_ids"].shape[1]), HOOK=case.hook, BATCH_TEXT=text,
                       KEYS={k.name: [k.padding, k.dtype] for k in case.keys},
                       FORMS=[{k: v for k, v in f.items() if k != "value"} for f in case.forms],
                       UNPACK=case.unpack is not None)
    p.functions = [subject.options_source(), _code_under_test(subject, case, constructor), *blocks, global_batch,
                   shard, judge, *([judge_keys] if case.keys else []), *([unpack] if case.unpack is not None else []),
                   *((run_forms, upstream_of, form_differences) if case.forms else ()), run_rank]
    return p


def _code_under_test(subject: Subject, case: ShardCase, constructor: str) -> str:
    part, hook = case.hook[0], case.hook[1]
    impl = (f"    module = importlib.import_module(args.impl)\n"
            f"    part = getattr(module, {part!r}, None) or importlib.import_module(args.impl + {'.' + part!r})\n"
            f"    batch = global_batch(arrays, \"marked\" if marked else \"batch\", device)\n"
            f"    return batch, getattr(part, HOOK[1])(batch, **HOOK[2])[\"cp_sharder\"]\n")
    doc = (f'    """``(batch, unresolved sharder)``: {part}.{hook} of the module ``args.impl``'
           + (f"; without it, the framework's sharder as {subject.module} builds it (copied below), on the batch "
              "as its hook leaves it" if subject.inlined else "") + '."""\n')
    head = "def code_under_test(args, arrays, device, marked=False):\n" + doc
    if not subject.inlined:
        return head + impl
    return (head + "    if not args.impl:\n        batch = global_batch(arrays, \"marked_hooked\" if marked else "
            f"\"hooked\", device)\n        return batch, {constructor}\n" + impl)


# ------------------------------------------------------------------------------ the script's own functions
# (they refer to the names every script defines: load_arrays, tensor, differs, code_under_test, the constants)
def global_batch(arrays: dict, prefix: str, device) -> dict:
    """The global batch stored under ``prefix/`` (a list's items under ``prefix/<key>/<i>``), on ``device``."""
    batch, lists = dict(BATCH_TEXT), {}  # type: ignore[var-annotated]  # (stripped from the script) filled below
    for name in arrays:
        if name.startswith(prefix + "/"):
            key, _, item = name[len(prefix) + 1:].partition("/")
            if item:
                lists.setdefault(key, {})[int(item)] = tensor(arrays, name, device)
            else:
                batch[key] = tensor(arrays, name, device)
    return {**batch, **{key: [items[i] for i in sorted(items)] for key, items in lists.items()}}


def shard(rank: int, args, mesh, device, arrays: dict, marked: bool = False) -> dict:
    """Shard the case's batch with the code under test inside the sharder's context, as a train step does: what
    this rank holds, the index map it reports, what ``shard_token_tensor`` cuts, the caller's tensors it changed
    (``marked``: the batch whose labels are ``arange(S)``, to see where each rank's tokens come from)."""
    batch, sharder = code_under_test(args, arrays, device, marked)
    loss_mask = tensor(arrays, "loss_mask", device) if "loss_mask" in arrays else None
    caller = {k: (v, v.clone()) for k, v in [*batch.items(), ("loss_mask", loss_mask)] if isinstance(v, torch.Tensor)}
    sharder = type(sharder)(device_mesh=mesh, shard_batch=sharder.shard_batch, padding_token_id=0, loss_mask=loss_mask,
                            local_token_global_indices=sharder.local_token_global_indices)  # the framework's resolution
    ctx_factory, local = sharder.shard(batch)
    with ctx_factory():
        held = {k: (local[k].tolist(), str(local[k].dtype)) for k in [*KEYS, "labels"]
                if isinstance(local.get(k), torch.Tensor)}
        layout = getattr(sharder, "shard_layout", None)
        index_map = getattr(layout, "local_token_global_indices", None)
        if index_map is None:
            padded = getattr(layout, "padded_seq_len", None) or WORLD * local["labels"].shape[1]
            index_map = sharder.local_token_global_indices(mesh, padded, device)
        marker = sharder.shard_token_tensor(torch.arange(S, device=device)[None], seq_dim=1, fill=-1)[0]
        forms = run_forms(rank, sharder, arrays, device) if FORMS else []
    changed = [f"{k} from {list(saved.shape)} to {list(v.shape)}" if v.shape != saved.shape else f"{k} (overwritten)"
               for k, (v, saved) in caller.items() if v.shape != saved.shape or not torch.equal(v, saved)]
    report = {"held": held, "map": index_map.reshape(-1).tolist(), "marker": marker.tolist(), "forms": forms,
              "changed": changed}
    if KEYS and not marked:
        report["follows"] = shard(rank, args, mesh, device, arrays, marked=True)["held"]["labels"][0][0]
    return report


def judge(reports: list, arrays: dict) -> list:
    """What is wrong in the ranks' reports: the caller's tensors, the index maps, each judged key."""
    wrong = [f"rank {r}: shard() changed the caller's {change} in place (a sharder must leave the caller's tensors "
             "unchanged)" for r, rep in enumerate(reports) for change in rep["changed"]]
    maps = [np.asarray(rep["map"], dtype=np.int64) for rep in reports]
    padded = sum(len(m) for m in maps)
    if not (np.array_equal(np.sort(np.concatenate(maps)), np.arange(padded)) and padded >= S
            and len({len(m) for m in maps}) == 1):
        return wrong + [f"the index maps {[m.tolist() for m in maps]} do not own every position of [0, {padded}) "
                        f"exactly once, in equal shards"]
    for r, (m, rep) in enumerate(zip(maps, reports)):
        if rep["marker"] != np.where(m < S, m, -1).tolist():
            wrong.append(f"rank {r}: its index map is {m.tolist()}, but shard_token_tensor(arange(S)) cuts "
                         f"{rep['marker']} (-1: padding)")
    return wrong + (judge_keys(reports, arrays, maps, bool(wrong)) if KEYS else [])


def judge_keys(reports: list, arrays: dict, maps: list, wrong_already: bool) -> list:
    """Each judged key of the local batch, put back at its global positions by the index maps ``maps``; when
    anything is wrong, where each rank's local labels come from."""
    wrong, padded = [], sum(len(m) for m in maps)
    for key, (padding, dtype) in KEYS.items():
        if any(key not in rep["held"] for rep in reports):
            wrong.append(f"ranks {[r for r, rep in enumerate(reports) if key not in rep['held']]}: the local batch "
                         f"holds no {key!r}")
            continue
        held = [np.asarray(rep["held"][key][0]) for rep in reports]
        if dtype and {rep["held"][key][1] for rep in reports} != {dtype}:
            wrong.append(f"{key}: local dtype {[rep['held'][key][1] for rep in reports]}, the caller's {dtype}")
        want, compared = arrays[f"expected/{key}"], arrays[f"compared/{key}"].astype(bool)
        if padding == "global":
            wrong += [w for r, h in enumerate(held) if (w := differs(f"rank {r}: {key}", torch.as_tensor(h), want,
                                                                     lambda i: f"row {i[0]}, position {i[1]}"))]
            continue
        if [h.shape[1] for h in held] != [len(m) for m in maps]:
            wrong.append(f"{key}: the ranks hold {[h.shape[1] for h in held]} positions, their index maps list "
                         f"{[len(m) for m in maps]}: {key} is not sharded like the tokens")
            continue
        got = np.zeros(want.shape[:1] + (padded,) + want.shape[2:], dtype=want.dtype)
        for m, h in zip(maps, held):
            got[:, m] = h
        full = np.concatenate([want, np.zeros_like(got[:, S:])], 1)
        full[:, S:] = got[:, S - 1:S] + np.arange(1, padded - S + 1) if padding == "count" else \
            (0 if padding == "free" else padding)
        mask = np.concatenate([compared, np.full(got[:, S:].shape[:2], padding != "free")], 1)
        owner = {int(p): r for r, m in enumerate(maps) for p in m}
        w = differs(key, torch.as_tensor(got), full, lambda i: f"row {i[0]}, global position {i[1]}, owned by rank "
                    f"{owner[i[1]]}" + (", divisibility padding" if i[1] >= S else ""), mask=mask)
        wrong += [w] if w else []
    if (wrong or wrong_already) and "follows" in reports[0] and any(f not in (-100, p) for rep, m in zip(reports, maps)
                                                 for f, p in zip(rep["follows"], m)):
        wrong += [f"  rank {r}: index map reported {m.tolist()}; its local labels are those of positions "
                  f"{rep['follows']} (sharded again with labels = arange(S); -100: padding or a masked label)"
                  for r, (m, rep) in enumerate(zip(maps, reports))]
    return wrong


def unpack(args, arrays: dict, device) -> list:
    """``unpack_row_layout`` of the module called on its own on the packed batch: what it wrote, against the
    layout (padding from the lengths, never from token values; positions on real tokens)."""
    module = importlib.import_module(args.impl)
    batch = global_batch(arrays, "batch", device)
    (getattr(module, "inkling2", None) or importlib.import_module(args.impl + ".inkling2")).unpack_row_layout(batch)
    keep = arrays["unpack/keep"]
    return [w for key, mask in (("padding_mask", None), ("position_ids", keep)) if (w := differs(
        f"unpack_row_layout {key}", batch.get(key), arrays[f"unpack/{key}"], lambda i: f"row {i[0]}, position {i[1]}",
        mask=mask))]


def run_forms(rank: int, sharder, arrays: dict, device) -> list:
    """Each token verb call of ``FORMS`` on this rank: its shard, the round trip, and the gradients (floats)."""
    out = []
    for i, form in enumerate(FORMS):
        x = tensor(arrays, f"form{i}/value", device)
        x.requires_grad_(x.is_floating_point())
        local = sharder.shard_token_tensor(x, seq_dim=form["seq_dim"], fill=form["fill"])
        back = sharder.gather_token_tensor(local, seq_dim=form["seq_dim"], trim=form["trim"], fill=form["fill"])
        result = {"local": local.detach().cpu().tolist(), "back": back.detach().cpu().tolist()}
        if x.is_floating_point():
            local.retain_grad()
            back.backward(upstream_of(i, rank, back.shape, back.dtype).to(device))
            result.update(local_grad=local.grad.cpu().tolist(), caller_grad=x.grad.cpu().tolist())
        out.append(result)
    return out


def upstream_of(i: int, rank: int, shape, dtype) -> torch.Tensor:
    """The upstream gradient of form ``i``'s round trip on ``rank``: small integers (every sum exact)."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + i)
    return torch.randint(-4, 5, tuple(shape), generator=g).to(dtype)


def form_differences(reports: list, arrays: dict) -> list:
    """Each verb call against the index map: the shard is the tensor padded with ``fill`` at the map, the round
    trip the tensor (or the padded one), each rank's gradients the sum of every rank's upstream at its positions."""
    maps, wrong = [torch.as_tensor(r["map"]) for r in reports], []
    for i, form in enumerate(FORMS):
        x, dim = torch.as_tensor(arrays[f"form{i}/value"]), form["seq_dim"]
        pad = list(x.shape)
        pad[dim] = sum(len(m) for m in maps) - x.shape[dim]
        padded = torch.cat([x, torch.full(pad, form["fill"], dtype=x.dtype)], dim)
        grad = torch.zeros_like(padded)
        if x.is_floating_point():
            out = x if form["trim"] else padded
            total = sum(upstream_of(i, r, out.shape, out.dtype) for r in range(WORLD))
            grad.narrow(dim, 0, total.shape[dim]).copy_(total)  # type: ignore[union-attr, arg-type]  # WORLD >= 1
        for r, (m, rep) in enumerate(zip(maps, reports)):
            got, own = rep["forms"][i], torch.zeros_like(grad).index_copy(dim, m, grad.index_select(dim, m))
            checks = [("shard_token_tensor", "local", padded.index_select(dim, m)),
                      ("gather_token_tensor", "back", x if form["trim"] else padded),
                      ("grad of the shard", "local_grad", grad.index_select(dim, m)),
                      ("grad of the caller's tensor", "caller_grad", own.narrow(dim, 0, x.shape[dim]))]
            wrong += [w for what, key, want in checks if key in got and (w := differs(
                f"rank {r}: form {i} {form}: {what}", torch.as_tensor(got[key], dtype=want.dtype), want.numpy(),
                lambda j: f"index {list(j)}"))]
    return wrong


def run_rank(rank: int, args, mesh, device) -> bool:
    """This rank shards the batch with the code under test and reports what it holds; rank 0 judges them all."""
    arrays = load_arrays()
    report = shard(rank, args, mesh, device, arrays)
    wrong = unpack(args, arrays, device) if UNPACK and rank == 0 else []
    reports = [report] if WORLD == 1 else [None] * WORLD
    if WORLD > 1:
        dist.all_gather_object(reports, report, group=mesh.get_group() if mesh is not None else None)  # plain data
    if rank == 0:
        wrong += judge(reports, arrays)
        wrong += form_differences(reports, arrays) if FORMS and not wrong else []
        print("\n".join(wrong) or "every rank holds what the contract expects", flush=True)
    return not wrong


def export(request, case: ShardCase) -> script.Plan:
    """The plan of ``case`` for ``request``: an adapter's hook runs here on a copy of the batch (what it leaves is
    what its sharder shards in the script; the sharder is copied in), an implementation's runs in the script."""
    subject = request.subject(".".join(case.hook[:2]), translate=False)
    sharder = None
    if subject.inlined:
        hooked = {k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v)
                  for k, v in case.batch.items()}
        module = importlib.import_module(subject.module)
        sharder = getattr(getattr(module, case.hook[0]), case.hook[1])(hooked, **case.hook[2])["cp_sharder"]
        if type(sharder).__module__.split(".")[0] == "cp_impl" or not _copyable(subject, sharder):
            # the adapter leaves this batch to cp_impl, or binds what a script cannot copy: import it by name
            subject, sharder = dataclasses.replace(subject, inlined=False), None
        else:
            case = dataclasses.replace(case, hooked=hooked)
    return plan(case, subject, request.name, request.case_text, sharder)


def roundtrip(request, value: torch.Tensor) -> script.Plan:
    """The plan of a ``sharder_roundtrip`` case: the hook's sharder on the case's batch, ``shard_token_tensor`` then
    ``gather_token_tensor`` (trimmed and not) on ``value`` (``[B, S, C]``, the check's), forward and backward."""
    case = request.case
    B, S, _ = case["shape"]
    batch = build_batch({"seed": case["seed"], "batch": {"format": "bshd", "seq_len": S, "rows": [[0, S]] * B},
                         "model": "inkling2"})
    forms = [{"value": value, "seq_dim": 1, "fill": False if value.dtype == torch.bool else 0, "trim": trim}
             for trim in (True, False)]
    return export(request, ShardCase(
        int(case["world_size"]), ("inkling2", "prepare_cp_inputs", {}), batch, [], {}, {},
        "shard_token_tensor(x, seq_dim=1, fill) returns this rank's positions of the index map (x padded with fill); "
        "gather_token_tensor(local, seq_dim=1, trim) puts every rank's shard back in global order (trim: the "
        "caller's length); the backward gives each rank's shard the sum of every rank's upstream gradient at its "
        "positions.", mesh=case.get("mesh") != "none", forms=forms))


def verbs(request, value, fill) -> script.Plan:
    """The plan of a ``sharder_verbs`` case on the implementation's own strategy: the caller's tensors, and each
    failing verb call on a tensor in the caller's coordinates (``value(case, i, shape, dtype)``, ``fill(form,
    dtype)``: the check's)."""
    case = request.case
    if case["layout"] != "strategy":
        raise NotExportable(f"a verb case on the {case['layout']!r} layout (one the harness reports itself) has no "
                            "standalone repro")
    B, S, dtype = int(case["rows"]), int(case["seq_len"]), case.get("value_dtype") or case["dtype"]
    batch = build_batch({"seed": case["seed"], "batch": {"format": "bshd", "seq_len": S, "rows": [[0, S]] * B},
                         "model": case.get("model", "inkling2")})
    report = request.report
    raised = report is None or any(p.kind is ProblemKind.RANK_RAISED for p in report.problems)
    failing = " ".join(c.name for c in report.failures()) if report is not None else ""
    forms = []
    for i, form in enumerate(case["forms"]):
        if (raised or f"form {i} " in failing) and form["coords"] == "caller":
            shape = [*form["lead"], B, S, *form["trail"]]
            forms.append({"value": value(case, i, shape, dtype), "seq_dim": 1 + len(form["lead"]),
                          "fill": fill(form, dtype), "trim": bool(form["trim"])})
    return export(request, ShardCase(
        int(case["world_size"]), (case.get("model", "inkling2"), "prepare_cp_inputs", {}), batch, [], {}, {},
        "after shard(batch) the sharder's verbs take tensors in the caller's coordinates: shard_token_tensor(x, "
        "seq_dim, fill) pads x with fill to the padded length and returns this rank's positions of the index map; "
        "gather_token_tensor(local, seq_dim, trim, fill) is its inverse (trim: back to the caller's length); the "
        "backward returns each rank's gradient at its own positions; shard() leaves the caller's tensors as they "
        "were.", mesh=case.get("mesh") != "none", forms=forms))
