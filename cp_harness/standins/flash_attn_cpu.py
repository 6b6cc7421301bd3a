"""Stand-in ``flash_attn_cpu``: flash-attn 2.8's four private per-block entry points computed on a CPU.

nemo-automodel 0.7.0's EAGLE-3 CP attention (``components/speculative/eagle/ring_attention.py``,
``zigzag_ring_attention.py``, ``ulysses_attention.py``) binds ``flash_attn.flash_attn_interface`` once, at import,
to a module attribute (``safe_import``: ``ring_attention._flash_attn``, ``zigzag_ring_attention._fa``,
``ulysses_attention._fa``), and calls exactly four functions of it, by position, in flash-attn 2.8.x's layout:

* ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
  return_softmax) -> (out, softmax_lse, S_dmask, rng_state)``: ``q [B, Sq, H, D]``, ``k``/``v [B, Sk, H, D]``;
  ``out [B, Sq, H, D]`` in ``q``'s dtype, ``softmax_lse [B, H, Sq]`` float32, the natural log of the sum of
  ``exp(scale * q.k)`` over the allowed keys;
* ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_left,
  window_right, softcap, alibi_slopes, deterministic, rng_state) -> softmax_d``: writes ``dq``/``dk``/``dv`` in
  place (they may be views: the zig-zag ring passes ``buf[:n]``);
* ``_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
  softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, return_softmax)``: ``q [total_q, H, D]``,
  documents ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` attend only to ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``;
  ``softmax_lse [H, total_q]``;
* ``_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
  deterministic, rng_state, zero_tensors)``.

What the backward reuses is the contract the rings depend on: flash-attn's backward does not recompute a softmax
of its own block, it takes the ``out`` and ``softmax_lse`` it is given, ``P = exp(scale * q.k - lse)`` and
``D = rowsum(dout * out)``, ``dS = P * (dout.v - D)``, ``dq = scale * dS.k``, ``dk = scale * dS^T.q``,
``dv = P^T.dout``. The rings pass the *merged* out and LSE of all blocks, so each block's gradients are those of the
joint softmax. This module computes exactly that, densely. Causal masks are aligned bottom-right when
``Sq != Sk`` (flash-attn >= 2.1: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``); a query row with no allowed
key gets output 0 and LSE ``+inf`` (flash-attn's convention, so that its backward contributes nothing).

Precision: bfloat16/float16 inputs compute in float32 and round once to the input dtype (out, dq, dk, dv); the LSE
is float32. The real kernel also rounds ``P`` and ``dS`` to the input dtype before its tensor-core matmuls; the
stand-in does not (that is the kernel's internal arithmetic, not its contract). Any other dtype is refused as the
kernel refuses it (``RuntimeError: FlashAttention only support fp16 and bf16 data type``); only inside
``wide_dtypes()`` (the stand-in's own unit tests, and the float32 repro of a latent ring defect) do float32 and
float64 compute in their own dtype (LSE in that dtype). Refused with ``NotImplementedError`` naming the argument: dropout, a sliding window, softcap, ALiBi, ``return_softmax``, fewer K/V heads than Q heads (the EAGLE
draft repeats K/V before CP: ``Eagle3LlamaAttention._repeat_kv``).

While installed, the three framework attributes hold a CPU namespace of these four functions (and the modules'
``HAVE_FLASH_ATTN`` is ``True``); on exit the attributes are back as they were (also after an exception).
``require_flash_attn_version`` (the recipe's setup gate, which reads the installed package's ``__version__``) is not
touched: the gate calls the attention functions, not the recipe.

**Importing them.** The three modules import with torch alone, but their package's ``__init__``
(``components/speculative/eagle/__init__.py``) imports every draft model, and ``draft_llama`` imports
``components/datasets/llm``, which needs Hugging Face ``datasets`` (not installed here, not a dependency of CP).
``framework_modules()`` imports the package normally and, only when that raises ``ModuleNotFoundError``, registers
the package without running its ``__init__`` (a package module whose ``__path__`` is its folder), so that the three
files are imported as they are; ``PACKAGE_INIT_SKIPPED`` then says why.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
from collections.abc import Iterator

import torch

from cp_harness.standins.registry import StandIn, register

# Where the framework binds flash-attn's interface module: (module, attribute, availability flag).
BINDINGS = (
    ("nemo_automodel.components.speculative.eagle.ring_attention", "_flash_attn", "HAVE_FLASH_ATTN"),
    ("nemo_automodel.components.speculative.eagle.zigzag_ring_attention", "_fa", "HAVE_FLASH_ATTN"),
    ("nemo_automodel.components.speculative.eagle.ulysses_attention", "_fa", "HAVE_FLASH_ATTN"),
)

PACKAGE = "nemo_automodel.components.speculative.eagle"
PACKAGE_INIT_SKIPPED: str | None = None  # why the package's __init__ was not run (None: it imported)

_calls = 0
_active = False
_wide = False
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def wide_dtypes() -> Iterator[None]:
    """Inside: float32 and float64 inputs are computed too (the real kernel refuses them; tests only)."""
    global _wide
    before, _wide = _wide, True
    try:
        yield
    finally:
        _wide = before


def framework_modules() -> list[types.ModuleType]:
    """The modules of ``BINDINGS``, imported (see "Importing them" above)."""
    global PACKAGE_INIT_SKIPPED
    if PACKAGE not in sys.modules:
        try:
            importlib.import_module(PACKAGE)
        except ModuleNotFoundError as exc:
            sys.modules.pop(PACKAGE, None)
            parent = importlib.import_module(PACKAGE.rsplit(".", 1)[0])
            folder = os.path.join(os.path.dirname(parent.__file__ or ""), PACKAGE.rsplit(".", 1)[1])
            spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
            spec.submodule_search_locations = [folder]
            package = importlib.util.module_from_spec(spec)
            package.__path__ = [folder]
            # the file it was not run from: without a __file__, inspect.getmodule (warnings, triton) fails on it
            package.__file__ = os.path.join(folder, "__init__.py")
            sys.modules[PACKAGE] = package
            PACKAGE_INIT_SKIPPED = f"{PACKAGE}.__init__ raised {type(exc).__name__}: {exc}"
    return [importlib.import_module(name) for name, _, _ in BINDINGS]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _refuse(dropout_p, window_left, window_right, softcap, alibi_slopes, return_softmax=False) -> None:
    for name, value, neutral in (
        ("dropout_p", float(dropout_p), 0.0),
        ("window_size_left", int(window_left), -1),
        ("window_size_right", int(window_right), -1),
        ("softcap", float(softcap), 0.0),
    ):
        if value != neutral:
            raise NotImplementedError(f"flash_attn_cpu: {name}={value} is not supported (only {neutral})")
    if alibi_slopes is not None:
        raise NotImplementedError("flash_attn_cpu: alibi_slopes is not supported (only None)")
    if return_softmax:
        raise NotImplementedError("flash_attn_cpu: return_softmax=True is not supported")


def _allowed(len_q: int, len_k: int, causal: bool, device) -> torch.Tensor:
    """``[len_q, len_k]`` bool: which keys each query sees (causal: bottom-right aligned)."""
    if not causal:
        return torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    return j <= i + (len_k - len_q)


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in KERNEL_DTYPES and not (_wide and q.dtype in (torch.float32, torch.float64)):
        raise RuntimeError(
            f"FlashAttention only support fp16 and bf16 data type (flash_attn_cpu, as the kernel: got {q.dtype})"
        )
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        raise NotImplementedError(
            f"flash_attn_cpu: K/V with {k.shape[-2]} heads for Q with {q.shape[-2]} (GQA/MQA) is not supported; "
            "repeat K/V to the query heads first"
        )


def _block_forward(q, k, v, allowed, scale):
    """One block: ``q [Tq, H, D]``, ``k``/``v [Tk, H, D]`` (compute dtype), ``allowed [Tq, Tk]`` ->
    ``(out [Tq, H, D], lse [H, Tq])``."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]; -inf where no key is allowed
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, torch.where(empty, torch.full_like(lse, math.inf), lse)


def _block_backward(dout, q, k, v, out, lse, allowed, scale):
    """The backward of one block against the given ``out`` / ``lse`` (see the module docstring); all ``[T, H, D]``
    and ``lse [H, Tq]`` in the compute dtype -> ``(dq, dk, dv, softmax_d [H, Tq])``."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.exp(scores - lse[..., None]).masked_fill(~allowed, 0.0)  # lse +inf (empty row): 0
    d = (dout * out).sum(-1).transpose(0, 1)  # [H, Tq]
    dv = torch.einsum("hqk,qhd->khd", probs, dout)
    dp = torch.einsum("qhd,khd->hqk", dout, v)
    ds = probs * (dp - d[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, k) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    return dq, dk, dv, d


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi, ret):
    global _calls
    _refuse(dropout_p, window_left, window_right, softcap, alibi, ret)
    _check_heads(q, k, v)
    _calls += 1
    c = _compute_dtype(q.dtype)
    allowed = _allowed(q.shape[1], k.shape[1], bool(causal), q.device)
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse = _block_forward(q[b].to(c), k[b].to(c), v[b].to(c), allowed, softmax_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs).to(q.dtype), torch.stack(lses), None, None


def _flash_attn_backward(
    dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, wl, wr, softcap, alibi, det, rng=None
):
    global _calls
    _refuse(dropout_p, wl, wr, softcap, alibi)
    _check_heads(q, k, v)
    _calls += 1
    c = _compute_dtype(q.dtype)
    allowed = _allowed(q.shape[1], k.shape[1], bool(causal), q.device)
    ds = []
    for b in range(q.shape[0]):
        grads = _block_backward(
            dout[b].to(c), q[b].to(c), k[b].to(c), v[b].to(c), out[b].to(c), lse[b].to(c), allowed, softmax_scale
        )
        dq[b].copy_(grads[0])
        dk[b].copy_(grads[1])
        dv[b].copy_(grads[2])
        ds.append(grads[3])
    return torch.stack(ds).to(lse.dtype)


def _documents(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, device) -> torch.Tensor:
    """``[total_q, total_k]`` bool: document ``i``'s queries see only document ``i``'s keys (causal within it)."""
    bq, bk = [int(x) for x in cu_q.tolist()], [int(x) for x in cu_k.tolist()]
    if len(bq) != len(bk):
        raise ValueError(f"flash_attn_cpu: cu_seqlens_q has {len(bq)} entries, cu_seqlens_k {len(bk)}")
    allowed = torch.zeros(bq[-1], bk[-1], dtype=torch.bool, device=device)
    for i in range(len(bq) - 1):
        allowed[bq[i] : bq[i + 1], bk[i] : bk[i + 1]] = _allowed(bq[i + 1] - bq[i], bk[i + 1] - bk[i], causal, device)
    return allowed


def _varlen_shapes(q, k, cu_q, cu_k) -> None:
    if int(cu_q[-1]) != q.shape[0] or int(cu_k[-1]) != k.shape[0]:
        raise ValueError(
            f"flash_attn_cpu: cu_seqlens end at {int(cu_q[-1])} / {int(cu_k[-1])} for {q.shape[0]} queries and "
            f"{k.shape[0]} keys"
        )


def _flash_attn_varlen_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, wl=-1, wr=-1, softcap=0.0, alibi=None,
    ret=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
):  # fmt: skip
    global _calls
    _refuse(dropout_p, wl, wr, softcap, alibi, ret)
    _check_heads(q, k, v)
    _varlen_shapes(q, k, cu_q, cu_k)
    _calls += 1
    c = _compute_dtype(q.dtype)
    allowed = _documents(cu_q, cu_k, bool(causal), q.device)
    out, lse = _block_forward(q.to(c), k.to(c), v.to(c), allowed, softmax_scale)
    return out.to(q.dtype), lse, None, None


def _flash_attn_varlen_backward(
    dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, wl, wr,
    softcap, alibi, det, rng=None, zero_tensors=False,
):  # fmt: skip
    global _calls
    _refuse(dropout_p, wl, wr, softcap, alibi)
    _check_heads(q, k, v)
    _varlen_shapes(q, k, cu_q, cu_k)
    _calls += 1
    c = _compute_dtype(q.dtype)
    allowed = _documents(cu_q, cu_k, bool(causal), q.device)
    grads = _block_backward(dout.to(c), q.to(c), k.to(c), v.to(c), out.to(c), lse.to(c), allowed, softmax_scale)
    dq.copy_(grads[0])
    dk.copy_(grads[1])
    dv.copy_(grads[2])
    return grads[3].to(lse.dtype)


# What the framework's attribute holds while the stand-in is installed: the four entry points it calls.
CPU_INTERFACE = types.SimpleNamespace(
    _flash_attn_forward=_flash_attn_forward,
    _flash_attn_backward=_flash_attn_backward,
    _flash_attn_varlen_forward=_flash_attn_varlen_forward,
    _flash_attn_varlen_backward=_flash_attn_varlen_backward,
)


@contextlib.contextmanager
def install() -> Iterator[None]:
    """Bind ``CPU_INTERFACE`` at every site of ``BINDINGS`` for the block (imports the framework modules; a
    framework without them raises ``ModuleNotFoundError`` naming the module); restored on exit."""
    global _active
    if _active:
        raise RuntimeError("flash_attn_cpu is already installed in this process")
    modules = [(m, attr, flag) for m, (_, attr, flag) in zip(framework_modules(), BINDINGS)]
    saved = [(m, attr, flag, getattr(m, attr), getattr(m, flag)) for m, attr, flag in modules]
    _active = True
    try:
        for m, attr, flag in modules:
            setattr(m, attr, CPU_INTERFACE)
            setattr(m, flag, True)
        yield
    finally:
        for m, attr, flag, value, have in saved:
            setattr(m, attr, value)
            setattr(m, flag, have)
        _active = False


def calls() -> int:
    """How many of the four entry points ran in this process (a one-rank Ulysses or ring run still calls one)."""
    return _calls


FLASH_ATTN_CPU = register(
    StandIn(
        name="flash_attn_cpu",
        device_type="cpu",
        replaces="flash-attn 2.8's _flash_attn_forward / _flash_attn_backward / _flash_attn_varlen_forward / "
        "_flash_attn_varlen_backward (CUDA)",
        role="flash-attn per-block kernels (dense and varlen, forward and backward against the given out/LSE)",
        computes_with="dense masked softmax attention and its closed-form backward (float32 for bf16/fp16)",
        meets="flash_attn",
        install=install,
        calls=calls,
        reference_too=True,
    )
)
