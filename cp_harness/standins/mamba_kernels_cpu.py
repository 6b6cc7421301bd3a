"""Stand-in ``mamba_kernels_cpu``: mamba_ssm's and causal_conv1d's Triton / CUDA kernels routed to the packages'
own torch reference kernels on a CPU.

Nemotron V3's Mamba2 mixer (nemo-automodel 0.7.0, ``components/models/nemotron_v3/layers.py``) computes with four
kernel entry points, all device-only: ``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined`` (the
training path: fused causal conv + SSD chunk scan, with the gated RMSNorm and the output projection fused in when
no CP), ``mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn`` (the gated RMSNorm the CP path calls separately),
``causal_conv1d.causal_conv1d_fn`` and ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (the
prefill path, never reached in training). Installed with ``MAMBA_SKIP_CUDA_BUILD`` /
``CAUSAL_CONV1D_SKIP_CUDA_BUILD`` (``constraints/mamba.txt``), the packages hold their Triton kernels, which need a
GPU driver to run, no CUDA extension (``selective_scan_cuda``, ``causal_conv1d_cuda``, imported unconditionally
by ``mamba_ssm/__init__.py`` and ``causal_conv1d/cpp_functions.py``), and their torch reference kernels.

While installed, this stand-in

* makes the packages importable: each CUDA extension that is not installed is a placeholder module whose every
  attribute raises (``MissingExtension``: a CUDA kernel was reached that the stand-in does not route); the modules
  imported under it leave ``sys.modules`` on exit (the framework then fails as without the stand-in), and are
  reused on the next entry (imported once per process);
* routes the four entry points, as attributes of the modules the framework imports them from (it imports them
  inside ``forward``), to the packages' references: ``mamba_split_conv1d_scan_ref`` (causal conv, sequential
  selective scan, gated RMSNorm, output projection), ``rms_norm_ref``, ``causal_conv1d_ref`` and
  ``ssd_chunk_scan_combined_ref``;
* routes the three kernels those references themselves call to references as well: ``ssd_combined``'s
  ``causal_conv1d_fn`` -> ``causal_conv1d_ref``, ``selective_scan_interface.selective_scan_fn`` ->
  ``selective_scan_ref``, ``ssd_combined``'s ``rmsnorm_fn`` -> ``rms_norm_ref``.

No line of either package is copied: every computation is theirs, differentiated by autograd (the references are
plain torch). The Mamba CP code around the kernel (``MambaContextParallel``: undoing the load-balanced layout, the
all-to-alls and their backward, the head / group slices of conv, ``dt_bias``, ``A_log``, ``D``) is the framework's.

**Where the references do not meet the kernels' contract** (what this stand-in does not give):

* ``mamba_split_conv1d_scan_ref`` normalizes over the whole ``dim`` (it calls ``rmsnorm_fn`` without a group size)
  where the fused kernel normalizes per group (``group_size = dim // ngroups``, ``ssd_combined.py``'s
  ``_layer_norm_fwd`` call). The stand-in passes the kernel's group size to ``rms_norm_ref`` for that call;
  otherwise the one-device mixer (fused norm) and the CP mixer (separate ``rmsnorm_fn``, per group) would compute
  different functions whenever ``ngroups > 1``.
* ``mamba_split_conv1d_scan_ref`` takes no ``seq_idx``; the mixer passes one whenever the model derives
  ``cu_seqlens`` (a one-row batch with a 2D attention mask: the real tokens are sequence 0, right padding sequence
  1). The stand-in gives the kernel's contract by calling the reference on each run of equal ``seq_idx`` of a row
  on its own (conv and scan state start afresh there, as in the kernel). No ``initial_states`` /
  ``return_final_states`` in the fused reference, and none of those nor ``seq_idx`` / ``cu_seqlens`` /
  ``dt_limit`` in the chunked one: refused (``NotImplementedError``), so the prefill path cannot silently
  compute something else. The chunked reference also asserts a length
  that is a multiple of ``chunk_size`` (the prefill path only; training never calls it).
* Rounding: the references compute the scan sequentially in float32 (``selective_scan_ref``), the kernels in
  chunks; on a CPU both the one-device and the CP model compute with the references, so what is judged is the CP
  code, not the kernels' rounding (which only the GPU nightly judges).

It ``meets`` ``cuda`` (the spec's ``REQUIRES`` key for these kernels); the ``mamba_ssm`` key stays: the packages
must be installed. Unlike the other stand-ins it is entered around the one-device runs too (``StandIn.
reference_too``): there is no CPU kernel for the reference to use.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from cp_harness.standins.registry import StandIn, register

EXTENSIONS = ("selective_scan_cuda", "causal_conv1d_cuda")
PACKAGES = ("mamba_ssm", "causal_conv1d")
SSD = "mamba_ssm.ops.triton.ssd_combined"
NORM = "mamba_ssm.ops.triton.layernorm_gated"
SCAN = "mamba_ssm.ops.selective_scan_interface"
CONV = "causal_conv1d"
CONV_INTERFACE = "causal_conv1d.causal_conv1d_interface"
_STATE: dict[str, Any] = {"calls": 0, "modules": None, "installed": False}


class MissingExtension(RuntimeError):
    """A CUDA extension of mamba_ssm / causal_conv1d was reached on a CPU (a kernel the stand-in does not route)."""


def _placeholder(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__doc__ = f"cp_harness placeholder: {name} (CUDA extension) is not built in this CPU install"

    def __getattr__(attr: str) -> Any:  # noqa: N807 - the module-level __getattr__ protocol
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise MissingExtension(
            f"{name}.{attr}: mamba_ssm / causal_conv1d's CUDA extension is not built here (CPU install); the "
            "stand-in mamba_kernels_cpu routes no call to it"
        )

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module._cp_harness_placeholder = True  # type: ignore[attr-defined]
    return module


def _ours(name: str) -> bool:
    return name in EXTENSIONS or any(name == p or name.startswith(p + ".") for p in PACKAGES)


def _import() -> dict[str, types.ModuleType]:
    """The packages' modules this stand-in routes through, imported once per process (with placeholders for the
    CUDA extensions that are not installed); returns every module imported under the placeholders."""
    before = set(sys.modules)
    for name in EXTENSIONS:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = _placeholder(name)
    for name in (SSD, NORM, SCAN, CONV, CONV_INTERFACE):
        importlib.import_module(name)
    return {name: sys.modules[name] for name in set(sys.modules) - before if _ours(name)} | {
        name: sys.modules[name] for name in (SSD, NORM, SCAN, CONV, CONV_INTERFACE)
    }


def _refuse(kernel: str, **arguments: Any) -> None:
    given = [name for name, value in arguments.items() if value is not None and value is not False]
    if given:
        raise NotImplementedError(
            f"stand-in mamba_kernels_cpu: {kernel} with {', '.join(given)}: the package's torch reference takes "
            "none (packed documents / states are not stood in)"
        )


def _by_sequence(ref, row, seq_idx):
    """``ref`` on each run of equal ``seq_idx`` of one row ``[1, S, ...]`` on its own, joined along the sequence:
    the kernel's ``seq_idx`` contract (the convolution and the scan state start afresh where ``seq_idx``
    changes), which ``mamba_split_conv1d_scan_ref`` does not take."""
    if seq_idx.shape != row.shape[1:2]:
        raise ValueError(
            f"stand-in mamba_kernels_cpu: seq_idx of shape {tuple(seq_idx.shape)} for a row {tuple(row.shape)}"
        )
    starts = [0] + [int(i) + 1 for i in torch.nonzero(seq_idx[1:] != seq_idx[:-1]).flatten()] + [row.shape[1]]
    return torch.cat([ref(row[:, a:b]) for a, b in zip(starts[:-1], starts[1:])], dim=1)


def _routes(mods: dict[str, types.ModuleType]) -> list[tuple[types.ModuleType, str, Any]]:
    """``(module, attribute, replacement)`` for every entry point the stand-in routes."""
    ssd, norm, scan, conv = mods[SSD], mods[NORM], mods[SCAN], mods[CONV_INTERFACE]
    ssd_ref, chunk_ref = ssd.mamba_split_conv1d_scan_ref, ssd.ssd_chunk_scan_combined_ref
    rms_norm_ref, conv_ref, scan_ref = norm.rms_norm_ref, conv.causal_conv1d_ref, scan.selective_scan_ref
    group = {"size": None}  # the fused kernel's RMSNorm group size, while its reference runs

    def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        return rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)

    def fused_rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        # the fused kernel's norm (ssd_combined: _layer_norm_fwd(..., group_size=dim // ngroups)); the reference's
        # own call passes no group size
        size = group_size if group_size is not None else group["size"]
        return rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=size, norm_before_gate=norm_before_gate)

    def causal_conv1d_fn(
        x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False, final_states_out=None,
        activation=None,
    ):  # fmt: skip
        _refuse("causal_conv1d_fn", seq_idx=seq_idx, initial_states=initial_states, final_states_out=final_states_out)
        return conv_ref(x, weight, bias, return_final_states=return_final_states, activation=activation)

    def selective_scan_fn(
        u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False
    ):
        return scan_ref(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        return_last_state=return_last_state)  # fmt: skip

    def mamba_split_conv1d_scan_combined(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
        dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
        rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
    ):  # fmt: skip
        _refuse(
            "mamba_split_conv1d_scan_combined",
            initial_states=initial_states,
            return_final_states=return_final_states,
        )
        _STATE["calls"] += 1
        nheads = D.shape[0]
        dim = nheads * (headdim if D.dim() == 1 else D.shape[1])

        def ref(part):
            return ssd_ref(
                part, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, dt_limit=dt_limit,
                activation=activation, rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps,
                outproj_weight=outproj_weight, outproj_bias=outproj_bias, headdim=headdim, ngroups=ngroups,
                norm_before_gate=norm_before_gate,
            )  # fmt: skip

        group["size"] = dim // ngroups
        try:
            if seq_idx is None:
                return ref(zxbcdt)
            return torch.cat([_by_sequence(ref, zxbcdt[b : b + 1], seq_idx[b]) for b in range(zxbcdt.shape[0])])
        finally:
            group["size"] = None

    def mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
        cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
        return_varlen_states=False,
    ):  # fmt: skip
        _refuse(
            "mamba_chunk_scan_combined",
            initial_states=initial_states,
            seq_idx=seq_idx,
            cu_seqlens=cu_seqlens,
            dt_limit=None if tuple(dt_limit) == (0.0, float("inf")) else dt_limit,
            return_final_states=return_final_states,
            return_varlen_states=return_varlen_states,
        )
        _STATE["calls"] += 1
        return chunk_ref(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)

    def counted(fn):
        def call(*args, **kwargs):
            _STATE["calls"] += 1
            return fn(*args, **kwargs)

        call.__name__ = fn.__name__
        return call

    return [
        (ssd, "mamba_split_conv1d_scan_combined", mamba_split_conv1d_scan_combined),
        (ssd, "mamba_chunk_scan_combined", mamba_chunk_scan_combined),
        (norm, "rmsnorm_fn", counted(rmsnorm_fn)),
        (mods[CONV], "causal_conv1d_fn", counted(causal_conv1d_fn)),
        # what the references call
        (ssd, "causal_conv1d_fn", causal_conv1d_fn),
        (ssd, "rmsnorm_fn", fused_rmsnorm_fn),
        (scan, "selective_scan_fn", selective_scan_fn),
    ]


@contextlib.contextmanager
def install() -> Iterator[None]:
    """Make the packages importable and route their kernel entry points to their references for the block; on
    exit (also after an exception) the packages' own attributes are back and the modules imported under the
    placeholders leave ``sys.modules`` (which holds the packages' names as before entry). Raises if already
    installed."""
    if _STATE["installed"]:
        raise RuntimeError("stand-in mamba_kernels_cpu is already installed (entered twice)")
    present = {name: module for name, module in sys.modules.items() if _ours(name)}
    if _STATE["modules"] is None:
        _STATE["modules"] = _import()
    mods: dict[str, types.ModuleType] = _STATE["modules"]
    sys.modules.update(mods)  # also over what a failed import outside left behind (mamba_ssm.ops, ...)
    routes = _routes(mods)
    saved = [(module, attr, module.__dict__.get(attr)) for module, attr, _ in routes]
    for module, attr, replacement in routes:
        replacement._cp_harness_standin = True
        setattr(module, attr, replacement)
    _STATE["installed"] = True
    try:
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(present)
        _STATE["installed"] = False


def installed() -> bool:
    """Whether the stand-in is installed in this process now."""
    return bool(_STATE["installed"])


MAMBA_KERNELS_CPU = register(
    StandIn(
        name="mamba_kernels_cpu",
        device_type="cpu",
        replaces="mamba_ssm's Triton kernels (mamba_split_conv1d_scan_combined, rmsnorm_fn, "
        "mamba_chunk_scan_combined) and causal_conv1d's CUDA causal_conv1d_fn",
        role="Mamba2 conv + SSD scan and gated RMSNorm kernels",
        computes_with="mamba_ssm's / causal_conv1d's torch references (mamba_split_conv1d_scan_ref with the "
        "kernel's RMSNorm group size, rms_norm_ref, causal_conv1d_ref, selective_scan_ref)",
        meets="cuda",
        install=install,
        calls=lambda: _STATE["calls"],
        reference_too=True,
    )
)
