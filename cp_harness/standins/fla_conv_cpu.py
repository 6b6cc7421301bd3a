"""Stand-ins ``fla_conv_cpu`` and ``fla_gloo_allgather``: fla's convolution CP (the halo exchange of
``fla.modules.causal_conv1d.cp``) on a CPU over gloo.

Qwen3.5-MoE's Gated DeltaNet layers under CP (nemo-automodel 0.7.0,
``components/models/qwen3_5_moe/cp_linear_attn.py``, ``CPAwareGatedDeltaNet._conv1d_with_cp``) call
``fla.modules.convolution.causal_conv1d(x, weight, bias, activation, cp_context=build_cp_context(...))`` per row.
fla 0.6.0 routes that to ``causal_conv1d_cp`` -> ``CausalConv1dFunctionCP``: in torch, the forward gathers every
rank's last ``W - 1`` inputs (``conv_cp_send_recv_fwd``: an ``all_gather_into_tensor``), builds the rank's
``initial_state`` ``[N, D, W]`` from the previous rank's tail (only as many tokens as the document has there,
``pre_num_conv_tokens``), and calls the Triton kernel ``causal_conv1d_fwd``; the backward calls the Triton kernel
``causal_conv1d_bwd`` (dx, dw, db, dr, dh0) and sends ``dh0``'s last ``W - 1`` columns to the previous rank
(``conv_cp_send_recv_bwd``), which adds them to its last ``W - 1`` input gradients. Two things stop it on a CPU:

* the two Triton kernels (no Triton driver on a CPU: ``RuntimeError: 0 active drivers ([]). There should only be
  one.``). ``fla_conv_cpu`` routes ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (the attributes of
  ``fla.modules.causal_conv1d``, which ``CausalConv1dFunctionCP`` imports at call time, and of its ``ops`` module,
  which fla's non-CP ``CausalConv1dFunction`` reads) to ``conv_fwd`` / ``conv_bwd`` below: the kernels' contract
  computed with ``torch.nn.functional.conv1d`` (depthwise, float32 accumulation as in the kernel) and autograd.
  fla ships no torch reference of this kernel (its test suite has one, the wheel does not), so these two
  functions are the harness's, unit-tested against the kernel's definition and against fla's own kernel source run
  by Triton's CPU interpreter (``tests/standins/test_fla_conv_cpu.py``; the interpreter is a test oracle only: it
  needs ``TRITON_INTERPRET=1`` before fla is imported, fla's autotuner cut to one config, and it cannot run fla's
  ``compute_dh0_kernel``).
* gloo's ``all_gather_into_tensor`` refuses the output fla allocates (``fla.ops.cp.comm.all_gather_into_tensor``:
  ``torch.empty(world_size, *inp.shape)``, stacked): ``ProcessGroupGloo::allgather: invalid tensor size at index 0
  (expected (2, 3), got (1, 2, 3))`` (``examples/automodel/repro/fla_stacked_allgather_gloo.py``). NCCL's
  ``_allgather_base`` checks only ``output.numel() == world_size * input.numel()``, and the stacked output is the
  concatenated one's memory. ``fla_gloo_allgather`` takes that NCCL branch, as the training step's gloo stand-in
  of finding D2 does: while installed, ``fla.ops.cp.comm``'s ``dist`` is a view of ``torch.distributed`` whose
  ``all_gather_into_tensor`` passes a stacked output on a gloo group as its concatenated view
  ``out.view(-1, *inp.shape[1:])`` (same memory); everything else, and every other backend, is torch's. fla's
  ``all_gather_into_tensor``, ``send_recv_fwd`` / ``send_recv_bwd`` (which rank's slice is taken, the zeros of rank 0
  / the last rank) and ``CausalConv1dFunctionCP`` run unchanged.

Neither stand-in touches a line of the CP logic: the halo's content (``pre_num_conv_tokens``, ``initial_state``
rows), the backward's ``dh0`` routing to the previous rank and the framework's per-row loop are fla's and the
framework's. What is not judged: the Triton kernels' own arithmetic (chunked, ``BD`` / ``BT`` tiles, the separate
``compute_dh0`` kernel), only on the GPU nightly.

**Not stood in: the gated delta rule.** ``chunk_gated_delta_rule(..., cp_context=...)`` is about 15 Triton kernels
(``chunk_local_cumsum``, the fused KKT / ``solve_tril`` WY representation, ``chunk_gated_delta_rule_fwd_h``,
``chunk_fwd_o``, their backward) plus the CP ones (``chunk_cp_fwd_h``, ``chunk_cp_merge``, ``chunk_cp_bwd_dh``),
and the CP pre-process refuses a CPU tensor outright (``fla.ops.cp.context._check_cp_device``: ``CP affine chains
require NVIDIA Ampere or newer``). Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.9.0) does not run them
either: the autotuner benchmarks through a driver (the same ``0 active drivers``), and with one config per kernel
``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` fails on ``i_t.to(tl.int64)`` (the interpreter's loop variable is
a Python ``int``). See ``docs/models/qwen3_5_moe.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from cp_harness.standins.registry import StandIn, register

CONV = "fla.modules.causal_conv1d"
CONV_OPS = "fla.modules.causal_conv1d.ops"
COMM = "fla.ops.cp.comm"
ACTIVATIONS = (None, "silu", "swish")
_STATE: dict[str, Any] = {"calls": 0, "installed": False, "gathers": 0, "gloo_installed": False}


def _check(activation: str | None, dht: torch.Tensor | None = None, output_final_state: bool = False) -> None:
    if activation not in ACTIVATIONS:
        raise NotImplementedError(f"stand-in fla_conv_cpu: activation {activation!r} (the kernel takes {ACTIVATIONS})")
    if dht is not None or output_final_state:
        raise NotImplementedError(
            "stand-in fla_conv_cpu: a final state (output_final_state / dht) is not stood in; the CP convolution "
            "passes neither"
        )


def _spans(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of each sequence ``n`` (the ``initial_state`` row): one per row, or, with
    ``cu_seqlens`` (one row), one per document."""
    if cu_seqlens is None:
        return [(b, 0, x.shape[1]) for b in range(x.shape[0])]
    if x.shape[0] != 1:
        raise ValueError(f"stand-in fla_conv_cpu: cu_seqlens needs one row, got {tuple(x.shape)}")
    bounds = [int(c) for c in cu_seqlens.tolist()]
    return [(0, a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _forward(x, weight, bias, residual, initial_state, activation, cu_seqlens):
    """The kernel's definition in float32: per sequence ``n``, ``y[t] = act(sum_j weight[:, j] * x[t - (W - 1) +
    j] + bias) + residual[t]``, where positions before the sequence's start read ``initial_state[n, :, W + t']``
    (its last ``W - 1`` columns; column 0 is never read) or 0 without one."""
    D, W = weight.shape
    w = weight.float()[:, None, :]
    b = bias.float() if bias is not None else None
    rows = []
    for n, (row, start, end) in enumerate(_spans(x, cu_seqlens)):
        xs = x[row, start:end].float()  # [L, D]
        if initial_state is not None:
            head = initial_state[n, :, 1:].float().T  # [W - 1, D]
        else:
            head = xs.new_zeros(W - 1, D)
        y = F.conv1d(torch.cat([head, xs]).T[None], w, b, groups=D)[0].T  # [L, D]
        if activation in ("silu", "swish"):
            y = y * torch.sigmoid(y)
        if residual is not None:
            y = y + residual[row, start:end].float()
        rows.append((row, y))
    if cu_seqlens is None:
        return torch.stack([y for _, y in rows])
    return torch.cat([y for _, y in rows])[None]


def conv_fwd(
    x, weight, bias, residual, initial_state=None, output_final_state=False, activation=None, cu_seqlens=None,
    cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False, **_: Any,
):  # fmt: skip
    """``fla.modules.causal_conv1d.causal_conv1d_fwd``'s contract: ``(y, final_state)``, ``y`` of ``x``'s shape and
    dtype (``chunk_indices`` / ``chunk_size`` / ``cu_seqlens_cpu``: the kernel's tiling only)."""
    _check(activation, output_final_state=output_final_state)
    _STATE["calls"] += 1
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.reshape(*x.shape[:2], -1)
    with torch.no_grad():
        y = _forward(x, weight, bias, residual, initial_state, activation, cu_seqlens)
    return y.to(x.dtype).view(shape), None


def conv_bwd(
    x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None, cu_seqlens=None,
    cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False, **_: Any,
):  # fmt: skip
    """``fla.modules.causal_conv1d.causal_conv1d_bwd``'s contract: ``(dx, dw, db, dr, dh0)`` of ``sum(y * dy)``:
    ``dx`` in ``x``'s dtype and shape, ``dw`` / ``db`` in the parameters' dtypes, ``dr`` is ``dy`` (with a residual),
    ``dh0`` ``[N, D, W]`` in ``initial_state``'s dtype (column 0 zero: never read)."""
    _check(activation, dht=dht)
    if weight is None:
        raise NotImplementedError("stand-in fla_conv_cpu: a convolution without weight is not stood in")
    _STATE["calls"] += 1
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.reshape(*x.shape[:2], -1)
    leaves = {
        "x": x.detach().float().requires_grad_(),
        "weight": weight.detach().float().requires_grad_(),
        "bias": None if bias is None else bias.detach().float().requires_grad_(),
        "initial_state": None if initial_state is None else initial_state.detach().float().requires_grad_(),
    }
    with torch.enable_grad():
        y = _forward(
            leaves["x"], leaves["weight"], leaves["bias"], None, leaves["initial_state"], activation, cu_seqlens
        )
        wanted = [name for name, t in leaves.items() if t is not None]
        grads = dict(zip(wanted, torch.autograd.grad(y, [leaves[n] for n in wanted], dy.reshape(y.shape).float())))
    dx = grads["x"].to(x.dtype).view(shape)
    dw = grads["weight"].to(weight.dtype)
    db = grads["bias"].to(bias.dtype) if bias is not None else None
    dr = dy if residual is not None else None
    dh0 = grads["initial_state"].to(initial_state.dtype) if initial_state is not None else None
    return dx, dw, db, dr, dh0


@contextlib.contextmanager
def install() -> Iterator[None]:
    """Route fla's convolution kernels (``fla.modules.causal_conv1d`` and its ``ops`` module) to ``conv_fwd`` /
    ``conv_bwd`` for the block; fla's own functions are back on exit (also after an exception)."""
    if _STATE["installed"]:
        raise RuntimeError("stand-in fla_conv_cpu is already installed (entered twice)")
    mods = [importlib.import_module(CONV), importlib.import_module(CONV_OPS)]
    saved = [(m, attr, m.__dict__[attr]) for m in mods for attr in ("causal_conv1d_fwd", "causal_conv1d_bwd")]
    for m, attr, _ in saved:
        setattr(m, attr, conv_fwd if attr == "causal_conv1d_fwd" else conv_bwd)
    _STATE["installed"] = True
    try:
        yield
    finally:
        for m, attr, original in saved:
            setattr(m, attr, original)
        _STATE["installed"] = False


def _stacked(out: torch.Tensor, inp: torch.Tensor, world: int) -> bool:
    return out.dim() == inp.dim() + 1 and out.shape[0] == world and tuple(out.shape[1:]) == tuple(inp.shape)


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor`` taking NCCL's branch on gloo: a stacked output
    ``[world, *inp.shape]`` is passed as its concatenated view (the same memory); anything else as given."""
    if torch_dist.get_backend(group) == "gloo" and _stacked(out, inp, torch_dist.get_world_size(group)):
        _STATE["gathers"] += 1
        flat = out.view(-1, *inp.shape[1:]) if inp.dim() else out.view(-1)
        return torch_dist.all_gather_into_tensor(flat, inp, group=group, async_op=async_op)
    return torch_dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


class _GlooDist(types.ModuleType):
    """``torch.distributed`` as fla's comm module sees it while ``fla_gloo_allgather`` is installed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch_dist, name)


@contextlib.contextmanager
def install_gloo() -> Iterator[None]:
    """``fla.ops.cp.comm.dist`` -> a view of ``torch.distributed`` with ``all_gather_into_tensor`` above, for the
    block; torch's module is back on exit."""
    if _STATE["gloo_installed"]:
        raise RuntimeError("stand-in fla_gloo_allgather is already installed (entered twice)")
    comm = importlib.import_module(COMM)
    original = getattr(comm, "dist")  # noqa: B009 - the module global fla's comm functions read
    if original is not torch_dist:
        raise RuntimeError(f"fla.ops.cp.comm.dist is {original!r}, not torch.distributed: the stand-in is stale")
    view = _GlooDist("torch.distributed")
    view.all_gather_into_tensor = all_gather_into_tensor  # type: ignore[attr-defined]
    setattr(comm, "dist", view)  # noqa: B010
    _STATE["gloo_installed"] = True
    try:
        yield
    finally:
        setattr(comm, "dist", original)  # noqa: B010
        _STATE["gloo_installed"] = False


def installed() -> bool:
    """Whether ``fla_conv_cpu`` is installed in this process now."""
    return bool(_STATE["installed"])


FLA_CONV_CPU = register(
    StandIn(
        name="fla_conv_cpu",
        device_type="cpu",
        replaces="fla's Triton causal_conv1d_fwd / causal_conv1d_bwd kernels",
        role="fla causal conv1d kernels",
        computes_with="depthwise torch conv1d in float32 and its autograd (the kernels' contract; harness code)",
        meets="cuda",
        install=install,
        calls=lambda: _STATE["calls"],
    )
)

FLA_GLOO_ALLGATHER = register(
    StandIn(
        name="fla_gloo_allgather",
        device_type="cpu",
        replaces="gloo's refusal of fla's stacked all_gather_into_tensor output",
        role="fla CP stacked all_gather_into_tensor on gloo",
        computes_with="the same collective into the output's concatenated view (NCCL's branch)",
        meets="",
        install=install_gloo,
        calls=lambda: _STATE["gathers"],
    )
)
