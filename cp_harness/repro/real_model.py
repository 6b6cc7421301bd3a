"""Scripts of a real model's CP step against the same model on one device, computed inside the script.

The code under test is the model spec module (imported by name, not inlined: the spec *is* the model's CP path,
the framework's classes and sharder as a training step uses them, a few hundred lines that a maintainer
changes in place; ``--spec`` runs another). Every rank builds the model and the batch from the spec, runs one
training step the framework's way (``step``: shard, forward inside the sharder's context, the loss over the
rank's labels divided by the global label count, backward, gradients and loss summed over the ranks, logits
gathered); rank 0 then runs the same step on one device twice, plainly and with the batch rows reversed and the
loss's gradient backpropagated in position chunks (the reference spread), and judges every tensor as the check
does: its normwise error in ULPs of the dtype at its largest one-device value must be at most ``C x spread +
FLOOR`` (the spread: the worst of its kind, logits, loss or parameter gradients). No arrays are needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cp_harness.repro import script
from cp_harness.repro.subjects import module_subject

# Placeholders of the script's constants (script.py writes each script's own).
SPEC, DTYPE, SEED, C, FLOOR, WORLD = "", "float32", 0, 4.0, 1024.0, 1
OVERRIDES: dict[str, Any] = {}
BATCH: dict[str, Any] = {}


def plan(request, c: float, floor: dict) -> script.Plan:
    """The script of a failing ``real_model`` case (``c``, ``floor``: the check's bound)."""
    case = request.case
    subject = module_subject(case["spec"])
    doc = [f"Repro: the model of the spec {case['spec']} at CP size {case['world_size']} ({case['dtype']}): its CP "
           "training step does not compute what the same model computes on one device.",
           "What it checks: every rank runs one training step of the model the framework's way (the spec's sharder, "
           "the forward inside its context, the loss over the rank's labels divided by the global label count, the "
           "gradients and the loss summed over the ranks, the logits gathered); rank 0 runs the same step on one "
           "device twice (plainly, and with a neutral change of reduction order: the reference spread) and compares "
           f"the logits at valid positions, the loss and every parameter gradient: the error in ULPs of {case['dtype']}"
           f" at the tensor's largest value must be at most {c:g} x the spread of its kind + {floor[case['dtype']]:g}."
           " The worst element of each failing tensor is printed; a rank that raises is named.",
           f"The code under test is the spec module {case['spec']} (imported by name: it is the model's CP path) and "
           "the framework classes it builds. Run from the repository root:",
           f"    PYTHONPATH={':'.join(subject.pythonpath or ('.',))} python {script.SCRIPT}  # exit 1 while the defect is "
           "there, 0 once fixed\n    ... --spec examples.automodel.models.deepseek_v41             # another spec "
           "(the bundled one passes)", f"Exported by cp_harness from the case {request.case_text}."]
    p = script.Plan(name=request.name, doc=doc, world=int(case["world_size"]), arrays={}, timeout=600)
    p.constants.update(SPEC=case["spec"], DTYPE=case["dtype"], SEED=int(case.get("seed", 0)),
                       OVERRIDES=case.get("overrides") or {}, BATCH=case["batch"], C=c, FLOOR=floor[case["dtype"]])
    p.functions = [options, step, normwise, run_rank]
    return p


# ------------------------------------------------------------------------------ the script's own functions
def options(parser) -> None:
    parser.add_argument("--spec", default=SPEC, metavar="MODULE", help="the model spec module under test")


def step(spec, model, mesh, batch: dict, split: int = 1, reverse: bool = False) -> dict:
    """One forward and backward the framework's way: ``{"logits" [B, S, V] global, "loss", "grads"}``. On one device
    (``mesh=None``) ``reverse`` reverses the batch rows and ``split`` backpropagates the loss's gradient in that
    many position chunks (the same result up to the order of its sums)."""
    rows = batch["input_ids"].shape[0]
    order = list(range(rows))[::-1] if reverse else list(range(rows))
    batch = {k: v[order] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v
             for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    count = spec.num_label_tokens(batch)
    ctx_factory, local, sharder = spec.shard(model, mesh, batch)
    with ctx_factory():
        logits = spec.forward(model, local)
        labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
        loss = spec.loss(logits, labels, count)
        (upstream,) = torch.autograd.grad(loss, logits, retain_graph=True)
        bounds = np.linspace(0, logits.shape[1], split + 1).round().astype(int)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            chunk = torch.zeros_like(upstream)
            chunk[:, a:b] = upstream[:, a:b]
            logits.backward(chunk, retain_graph=i < split - 1)
        total = loss.detach().float().clone()
    full = spec.gather_logits(sharder, logits.detach())[[order.index(r) for r in range(rows)]]
    out = {"logits": full.float(), "loss": total}
    for name, p in model.named_parameters():
        if p.requires_grad:  # summed over the ranks in float32, rounded once to the parameter's dtype
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().clone()
            if mesh is not None:
                dist.all_reduce(grad)
            out[f"grad {name}"] = grad.to(p.dtype).float()
    if mesh is not None:
        dist.all_reduce(total)
    return out


def normwise(actual, expected, mask=None):
    """``(error in ULPs of DTYPE at the largest |expected|, index of the worst element)``."""
    a, e = actual.double().numpy(), expected.double().numpy()
    if mask is not None:
        m = np.broadcast_to(mask.reshape(mask.shape + (1,) * (e.ndim - mask.ndim)), e.shape)
        a, e = np.where(m, a, 0.0), np.where(m, e, 0.0)
    diff, scale = np.abs(a - e), float(np.abs(e).max(initial=0.0))
    worst = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape)) if diff.size else ()
    unit, largest = float(torch.finfo(getattr(torch, DTYPE)).eps) * scale, float(diff.max(initial=0.0))
    return (largest / unit if unit > 0 else (0.0 if largest == 0 else float("inf"))), worst


def run_rank(rank: int, args, mesh, device) -> bool:
    """Every rank: the CP step; rank 0: the one-device steps and the judgement."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = importlib.import_module(args.spec)
    model = spec.build(getattr(torch, DTYPE), SEED, **OVERRIDES)
    keys = {k: v for k, v in BATCH.items() if k not in ("kind", "seq_len")}
    batch = spec.make_batch(BATCH["kind"], BATCH["seq_len"], **keys)
    cp = step(spec, model, mesh, batch)
    if rank != 0:
        return True
    ref, other = step(spec, model, None, batch), step(spec, model, None, batch, split=max(2, WORLD), reverse=True)
    valid = spec.valid_positions(batch).bool().numpy()
    kind = {name: name.split(" ")[0] for name in ref}
    spread = {}  # type: ignore[var-annotated]  # (stripped from the script) kind -> its worst spread, filled below
    for name in ref:
        spread[kind[name]] = max(spread.get(kind[name], 0.0), normwise(other[name], ref[name],
                                                                        valid if name == "logits" else None)[0])
    wrong = []
    for name in ref:
        if cp[name].shape != ref[name].shape:
            wrong.append(f"{name}: CP shape {list(cp[name].shape)}, one device {list(ref[name].shape)}")
            continue
        error, worst = normwise(cp[name], ref[name], valid if name == "logits" else None)
        bound = C * spread[kind[name]] + FLOOR
        if not error <= bound:
            wrong.append(f"{name}: CP error {error:.3g} ULP > bound {bound:.3g} (= {C:g} x spread "
                         f"{spread[kind[name]]:.3g} + {FLOOR:g}); worst at "
                         + (f"row {worst[0]}, global position {worst[1]}, vocabulary entry {worst[2]}"
                            if name == "logits" else f"index {list(worst)}") + ": CP "
                         f"{cp[name][worst].item()!r}, one device {ref[name][worst].item()!r}")
    print("\n".join(wrong) or "CP computes what one device computes", flush=True)
    return not wrong
