"""Real models through a *model spec*: loading and validating a spec module, one model per (spec, dtype, seed)
in a rank process, one training step the framework's way, and the normwise judge without a float64 oracle.

A model spec is a module meeting ``cp_harness.usage.spec_contract.ModelSpec``, checked when it loads
(``examples/automodel/models/deepseek_v41.py`` is the worked example; ``docs/extending.md`` writes one); optional
functions enable more (the padding check needs ``pad_batch`` and ``cp_padded_length``; the kernel check
``cp_kernels``). ``step`` runs one forward
and backward:

* on CP ranks (``mesh`` a 1-D ``"cp"`` DeviceMesh): ``spec.shard`` (the framework's sharder), the forward in
  ``ctx_factory()``, the loss over this rank's labels divided by the *global* label count, backward, the
  parameter gradients and the loss summed over the CP group (in float32, rounded once to the parameter's
  dtype), the logits gathered to global order with ``spec.gather_logits``;
* on one device (``mesh=None``), optionally under a semantically neutral change of reduction order
  (``split``: the loss's gradient with respect to the logits cut into that many position chunks, each
  backpropagated on its own so that the parameter gradients accumulate as partial sums; the loss itself is
  computed once, as in the plain run, so a defect in the spec's loss cannot widen the spread; ``reverse``: the batch rows in reverse order). The difference between
  the plain and the reordered one-device run is the *reference spread* the judge scales its bound with.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import types
from typing import Any

import numpy as np
import torch

from cp_harness.judging.compare import ulp_errors
from cp_harness.usage.spec_contract import SpecError, SpecTraits, check_spec  # noqa: F401 - SpecError re-exported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _inductor_cache_per_kernel_set() -> None:
    """One torch inductor cache per ATen CPU capability. Its cache key ignores ``ATEN_CPU_CAPABILITY``: after a
    native (AVX-512) run, the framework's compiled MoE activation was looked up under ``=default`` and failed to
    build ('at::vec has not been declared'); with the caches disabled, or one per capability, it compiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:  # unset, or inductor's own default (it writes it)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{torch.backends.cpu.get_cpu_capability().lower()}"


@functools.cache
def load_spec(name: str) -> types.ModuleType:
    """Import the spec module ``name`` and check it against the contract (``spec_contract.check_spec``);
    ``SpecError`` names every field that is missing or wrong."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # specs build from a config: no Hub lookups (20-30 s otherwise)
    _inductor_cache_per_kernel_set()
    module = importlib.import_module(name)
    check_spec(name, module)
    return module


def spec_traits(name: str) -> SpecTraits:
    """The optional declarations of spec ``name`` (loaded and checked once)."""
    return check_spec(name, load_spec(name))


_MODELS: dict[tuple, torch.nn.Module] = {}
_COMPILED_FOR: list[str] = []  # the spec of the last case this process ran (at most one name)


def one_spec_at_a_time(name: str) -> None:
    """Before a case of spec ``name``: when this process's last case was another spec's, forget what
    ``torch.compile`` compiled for that one (``torch.compiler.reset()``; the built models stay cached).

    The framework compiles small functions that the models of a family share (MoE activations, FlexAttention and its
    block masks), and dynamo compiles one function at most ``recompile_limit`` (8) times before a ``fullgraph=True``
    call fails hard. One spec's cases stay within that, as the framework's own runs do (one model a process); the
    cases of several specs on the same ranks did not: with every spec of the gate on shared pools
    (``examples/automodel/tools/pools.py``), glm5_next's and llama3_flex_ptrr's first cases after other specs raised
    ``FailOnRecompileLimitHit`` (measured; ``tests/usage/test_model_specs.py`` keeps it)."""
    if _COMPILED_FOR and _COMPILED_FOR[0] != name:
        torch.compiler.reset()
    _COMPILED_FOR[:] = [name]


def cached_model(name: str, dtype: str, seed: int, overrides: dict | None = None) -> torch.nn.Module:
    """The spec's model for (``name``, ``dtype``, ``seed``, ``overrides``), built once per process; each call is a
    case of that spec (``one_spec_at_a_time``)."""
    one_spec_at_a_time(name)
    key = (name, dtype, int(seed), tuple(sorted((overrides or {}).items())))
    if key not in _MODELS:
        _MODELS[key] = load_spec(name).build(DTYPES[dtype], int(seed), **(overrides or {}))
    return _MODELS[key]


def make_batch(spec: types.ModuleType, description: dict) -> dict:
    """The global batch a case's ``batch`` key describes (``kind``, ``seq_len``, and ``spec.make_batch``'s keywords)."""
    keys = dict(description)
    return spec.make_batch(keys.pop("kind"), int(keys.pop("seq_len")), **keys)


# Batch keys flat over the images / videos of all rows (not over rows): only the spec can reorder them with the rows.
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _row_order(spec: types.ModuleType, batch: dict, order: list[int]) -> dict:
    """``batch`` with its rows in ``order``: ``spec.reorder_rows(batch, order)`` where the spec has it, else every
    tensor whose first dimension is the row count. A batch with media (``MEDIA_KEYS``: flat over the images, so a
    tensor of as many patches as rows would be reordered as if it were rows) needs the spec's ``reorder_rows``.
    ``order`` may name a subset of the rows (``select_rows``)."""
    if hasattr(spec, "reorder_rows"):
        return spec.reorder_rows(batch, list(order))
    media = [k for k in MEDIA_KEYS if batch.get(k) is not None]
    if media:
        raise ValueError(
            f"model spec {spec.NAME!r}: the batch carries {media}, flat over its images, which the reordered reference "
            "cannot reverse with the rows by shape; give the spec reorder_rows(batch, order)"
        )
    rows = batch["input_ids"].shape[0]
    return {
        k: (v[list(order)] if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == rows else v)
        for k, v in batch.items()
    }


def select_rows(spec: types.ModuleType, batch: dict, rows: range | list[int]) -> dict:
    """The sub-batch of ``batch``'s rows ``rows`` (in that order; ``[B, ...]`` tensors -> ``[len(rows), ...]``) with
    their images: a data-parallel rank's rows, or one micro-batch of the one-device reference. Through the spec's
    ``reorder_rows`` where it has one (the media ``pixel_values [P, C]`` / ``image_grid_thw [I, 3]`` are flat over
    the images of all rows and cannot be cut by shape); a batch with media and no ``reorder_rows`` raises naming the
    fix. Rows that hold no image give a batch without media keys, as a collater's text-only batch."""
    return _row_order(spec, batch, list(rows))


def step(
    spec: types.ModuleType,
    model: torch.nn.Module,
    mesh: Any,
    batch: dict,
    *,
    split: int = 1,
    reverse: bool = False,
    backward: bool = True,
    num_label_tokens: int | None = None,
) -> dict[str, Any]:
    """One forward and backward; ``{"logits" [B, S, V] global, "loss" [], "grads" {name: tensor}}`` (detached).

    With ``mesh`` every rank of the mesh calls this with the same global ``batch`` and gets the same result.
    ``backward=False`` (a device where the model has no backward kernel): the forward and the loss only, under
    ``torch.no_grad()``, no gradients (``grads`` empty). ``num_label_tokens``: the loss's divisor (default the batch's
    own count; a micro-batch of a larger step passes the step's count, as the recipe does).
    """
    group = mesh.get_group() if mesh is not None else None
    rows = batch["input_ids"].shape[0]
    order = list(range(rows))[::-1] if reverse else list(range(rows))
    if reverse:
        batch = _row_order(spec, batch, order)
    model.zero_grad(set_to_none=True)
    count = spec.num_label_tokens(batch) if num_label_tokens is None else num_label_tokens
    ctx_factory, local, sharder = spec.shard(model, mesh, batch)
    # Without a backward the forward runs without autograd too: a kernel without a backward (FlexAttention on the
    # CPU) refuses inputs that require grad.
    with ctx_factory(), contextlib.nullcontext() if backward else torch.no_grad():
        logits = spec.forward(model, local)
        labels = spec.local_labels(local) if hasattr(spec, "local_labels") else local["labels"]
        value = spec.loss(logits, labels, count)
        if not backward:
            pass
        elif split <= 1:
            value.backward()
        else:  # the same loss, its backward cut into position chunks: parameter gradients accumulate partial sums
            (upstream,) = torch.autograd.grad(value, logits, retain_graph=True)
            bounds = np.linspace(0, logits.shape[1], split + 1).round().astype(int)
            parts = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            # What every backward through the logits adds whatever the upstream gradient (an auxiliary loss injected
            # in the backward, e.g. a router's load-balancing loss): counted once, as in the plain run, not per chunk.
            params = [p for p in model.parameters() if p.requires_grad]
            constant = torch.autograd.grad(
                logits, params, grad_outputs=torch.zeros_like(logits), retain_graph=True, allow_unused=True
            )
            for i, (a, b) in enumerate(parts):
                chunk = torch.zeros_like(upstream)
                chunk[:, a:b] = upstream[:, a:b]
                logits.backward(chunk, retain_graph=i < len(parts) - 1)
            with torch.no_grad():
                for parameter, extra in zip(params, constant):
                    if extra is not None and parameter.grad is not None and len(parts) > 1:
                        parameter.grad.sub_(extra, alpha=len(parts) - 1)
        total = value.detach().float().clone()
    full = spec.gather_logits(sharder, logits.detach())
    grads = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad or not backward:
            continue
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        grad = grad.detach().float().clone()
        if group is not None:
            torch.distributed.all_reduce(grad, group=group)
        grads[name] = grad.to(parameter.dtype)
    if group is not None:
        torch.distributed.all_reduce(total, group=group)
    if reverse:
        full = full[[order.index(r) for r in range(rows)]]
    return {"logits": full.detach(), "loss": total, "grads": grads}


# ---- the judge: CP against one rank, bound c x reference spread + floor, normwise -----------------------------


def ulp_unit(dtype: str) -> float:
    """The unit of every error of a ``dtype`` model: its machine epsilon (one ULP at 1)."""
    return float(torch.finfo(DTYPES[dtype]).eps)


def normwise(actual: np.ndarray, expected: np.ndarray, scale: float, unit: float) -> tuple[float, np.ndarray]:
    """``(max |actual - expected| / (scale x unit), |actual - expected|)``: ULPs at the tensor's largest value
    (``cp_harness.judging.compare.ulp_errors`` with the scale as every element's unit)."""
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    if not diff.size:
        return 0.0, diff
    if scale <= 0:
        return (0.0 if float(diff.max()) == 0 else float("inf")), diff
    return float(ulp_errors(actual, expected, unit, scale).max()), diff


def judge_tensor(
    cp: np.ndarray,
    ref: np.ndarray,
    other: np.ndarray,
    dtype: str,
    c: float,
    floor: float,
    mask: np.ndarray | None = None,
    spread: float | None = None,
    scale_floor: float = 0.0,
) -> dict[str, Any]:
    """CP ``cp`` against the one-device ``ref``; ``other`` is the reordered one-device run (the spread).

    ``mask`` (broadcast over trailing dimensions) selects the compared elements. Returns the errors in ULPs
    of ``dtype`` at the tensor's largest reference value, the bound ``c x spread + floor``, ``ok``, how many
    elements exceed the element-wise bound, and the worst element. ``spread``: the reference spread to scale
    the bound with (default: this tensor's own; the check passes the worst over the tensor's class).
    ``scale_floor``: the least scale the ULPs are measured at (the tensor's largest value, or this if larger).
    """
    cp, ref, other = (np.asarray(x, dtype=np.float64) for x in (cp, ref, other))
    if cp.shape != ref.shape:
        return {"ok": False, "shape_problem": f"CP shape {list(cp.shape)}, one rank {list(ref.shape)}"}
    if mask is not None:
        m = np.broadcast_to(mask.reshape(mask.shape + (1,) * (ref.ndim - mask.ndim)), ref.shape)
        cp, ref, other = (np.where(m, x, 0.0) for x in (cp, ref, other))
    unit = ulp_unit(dtype)
    scale = max(float(np.abs(ref).max()) if ref.size else 0.0, float(scale_floor))
    error, diff = normwise(cp, ref, scale, unit)
    own_spread, _ = normwise(other, ref, scale, unit)
    spread = own_spread if spread is None else spread
    bound = c * spread + floor
    ok = error <= bound
    above = int((diff > bound * scale * unit).sum()) if scale > 0 else int((diff > 0).sum())
    flat = int(diff.argmax()) if diff.size else 0
    worst = tuple(int(i) for i in np.unravel_index(flat, diff.shape)) if diff.size else ()
    return {
        "ok": bool(ok),
        "error": error,
        "spread": spread,
        "own_spread": own_spread,
        "bound": bound,
        "scale": scale,
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "above": above,
        "worst_index": worst,
        "worst_actual": float(cp[worst]) if diff.size else 0.0,
        "worst_expected": float(ref[worst]) if diff.size else 0.0,
    }


def padding_repro_command(spec_name: str, dtype: str, seed: int, overrides: dict, batch: dict, padded_len: int) -> str:
    """A one-process command (no harness, no ranks) that prints how much appending masked pad tokens up to
    ``padded_len`` changes the model's logits at the real positions."""
    code = (
        f"import torch, importlib; s = importlib.import_module({spec_name!r}); "
        f"m = s.build(torch.{dtype}, {int(seed)}, **{overrides!r}).eval(); "
        f"b = s.make_batch(**{dict(batch)!r}); p = s.pad_batch(b, {padded_len}); "
        f"f = lambda x: s.forward(m, s.shard(m, None, x)[1]).detach(); S = b['input_ids'].shape[1]; "
        f"d = (f(b) - f(p)[:, :S]).abs().amax(-1); "
        f"print('max |logit change| from padding:', float(d.max()), 'at [row, position]', "
        f"[int(i) for i in torch.unravel_index(d.argmax(), d.shape)])"
    )
    return f'HF_HUB_OFFLINE=1 PYTHONPATH=. python -c "{code}"'


def kernel_repro_command(
    spec_name: str, dtype: str, seed: int, overrides: dict, batch: dict, padded_len: int | None = None
) -> str:
    """A one-process command (no harness, no ranks) that prints how much the CP path's kernels
    (``spec.cp_kernels``) change the model's one-device logits ``[B, S, V]`` at the valid positions: the largest
    absolute change, the same in ULPs of ``dtype`` at the largest plain logit (the harness's unit), and where.
    With ``padded_len`` the kernel run is on the batch right-padded to that length (``spec.pad_batch``), cut
    back to ``S``. Without autograd (FlexAttention has no CPU backward)."""
    other = f"s.pad_batch(b, {int(padded_len)})" if padded_len else "b"
    code = (
        f"import torch, importlib; torch.set_grad_enabled(False); s = importlib.import_module({spec_name!r}); "
        f"m = s.build(torch.{dtype}, {int(seed)}, **{overrides!r}); "
        f"b = s.make_batch(**{dict(batch)!r}); p = {other}; S = b['input_ids'].shape[1]; "
        f"f = lambda x: s.forward(m, s.shard(m, None, x)[1]).float()[:, :S]; a = f(b); "
        f"k = s.cp_kernels(m); what = k.__enter__(); c = f(p); k.__exit__(None, None, None); "
        f"v = s.valid_positions(b).bool()[..., None]; d = ((c - a).abs() * v).amax(-1); "
        f"u = float(d.max() / ((a.abs() * v).max() * torch.finfo(torch.{dtype}).eps)); "
        f"print('max |logit change| from the CP kernels (' + str(what) + '):', float(d.max()), '=', round(u, 1), "
        f"'ULP of {dtype} at the largest logit, at [row, position]', "
        f"[int(i) for i in torch.unravel_index(d.argmax(), d.shape)])"
    )
    return f'HF_HUB_OFFLINE=1 PYTHONPATH=. python -c "{code}"'


def preload(names: str) -> list[str]:
    """Import the spec modules named (comma-separated) in ``names`` once, in the launcher before it forks the
    ranks (so that no rank imports the framework's models and ``transformers`` on its own). A spec that fails
    here is reported by the case that uses it; the problems are returned."""
    problems = []
    for name in filter(None, names.split(",")):
        try:
            load_spec(name)
        except Exception as exc:  # noqa: BLE001 - the case names it again, on its rank
            problems.append(f"model spec {name!r}: {type(exc).__name__}: {exc}")
    return problems
