"""Stand-in ``glm_dsa_kernels_cpu``: GLM-5.2 DSA's TileLang kernels (the lighting indexer and the gather-top-k
sparse MLA, forward and backward) computed in torch on a CPU.

nemo-automodel 0.7.0's ``glm_moe_dsa`` runs context parallelism only with ``backend.attn`` in ``{"tilelang",
"cudnn"}`` (``layers.py`` raises ``NotImplementedError`` on the torch path under CP). The TileLang path calls
``optimized_kernels.tilelang_indexer_topk`` and ``tilelang_sparse_attention``; those wrappers (the framework's:
per-query key windows from ``cu_seqlens`` / ``cu_seqlens_padded``, selected by ``glm_dsa_cp_query_indices``; the
``w_vc`` value up-projection) call the vendored autograd functions ``kernels.indexer.IndexerFunction`` (top-k with
the ``-1`` sentinel, score extraction) and ``kernels.sparse_mla.SparseMLA``, and those call four TileLang entry
points, module attributes of ``kernels/indexer.py`` and ``kernels/sparse_mla.py``:

* ``indexer_fwd_interface(q [T, H, D] bf16, k [T_kv, D] bf16, weights [T, H] fp32, ks [T] int32, ke [T] int32,
  clean_logits=True) -> logits [T, T_kv] fp32``: ``sum_h relu(q[t, h] . k[j]) * weights[t, h]`` for
  ``ks[t] <= j < ke[t]``, ``-inf`` elsewhere (``clean_logits``), products of bfloat16 accumulated in float32;
* ``indexer_bwd_interface(q, weights, k, topk_indices [T, K] int32, grad_scores [T, K] fp32) -> (grad_q like q,
  grad_w fp32 [T, H], grad_k fp32 [T_kv, D])``: the gradient of the selected scores (``-1`` / out-of-range slots
  contribute nothing), ``relu'`` taken where ``q . k > 0``;
* ``sparse_mla_fwd_interface(q [T, H, 576] bf16, kv [T_kv, 1, 576] bf16, indices [T, 1, K] int32, sm_scale) ->
  (out [T, H, 512] bf16, lse [T, H] fp32)``: softmax attention of each query over the keys ``kv[indices]`` (``-1``
  skipped), value = the first 512 channels of ``kv``, ``lse`` in base 2 (``log2 sum exp(sm_scale * s)``);
* ``sparse_mla_bwd(q, kv, o, do, indices, lse, sm_scale) -> (dq like q, dkv [T_kv, 1, 576])``: the attention
  backward from the saved ``o`` and ``lse`` (``delta = rowsum(o * do)``, ``P = exp2(sm_scale * log2(e) * s -
  lse)``), dK and dV of repeated keys summed into ``dkv`` in float32.

While installed, this stand-in routes those four attributes to torch computations of exactly that contract
(float32 arithmetic on the bfloat16 inputs, the outputs in the kernels' dtypes), and refuses what the kernels
assert (``dim + tail_dim == 576``, ``topk % 64 == 0``, bfloat16 inputs, int32 windows / indices). It also lets the
framework's dispatch select the TileLang path on a CPU: ``optimized_kernels.HAS_TILELANG`` (whether the
``tilelang`` package is importable) reads true, and ``optimized_kernels._all_cuda`` (the "CUDA tensors" check of
``should_use_tilelang``) accepts CPU tensors; its bfloat16 check stays the framework's. Everything else stays
the framework's: both autograd functions, both wrappers (windows, query-index selection, ``w_vc``), the K/V
all-gather of CP (``cp.glm_dsa_cp_all_gather``) and its backward, the batch sharding. No framework code is
copied.

The TileLang kernels have no CPU implementation at all, so the one-device runs compute with the stand-in too
(``reference_too``): what is judged on a CPU is the framework's CP code, not TileLang's arithmetic (the GPU nightly).
The unit tests (``tests/standins/test_glm_dsa_kernels_cpu.py``) check the stand-in's path against the model's own
torch (non-CP) path on one device.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from cp_harness.standins.registry import StandIn, register

PACKAGE = "nemo_automodel.components.models.glm_moe_dsa"
OPTIMIZED = PACKAGE + ".optimized_kernels"
INDEXER = PACKAGE + ".kernels.indexer"
SPARSE_MLA = PACKAGE + ".kernels.sparse_mla"
LATENT_DIM = 512  # the kernels' value width (sparse_mla_fwd_interface's d_v, sparse_mla_bwd's D)
QK_DIM = 576  # sparse_mla_fwd_interface asserts dim_plus_tail_dim == 576
BLOCK_I = 64  # sparse_mla_fwd asserts topk % block_I == 0
LOG2E = 1.44269504
_STATE: dict[str, Any] = {"calls": 0, "installed": False}


class KernelContractError(ValueError):
    """An input the TileLang kernel would refuse (or mis-handle): the stand-in refuses it too, naming the field."""


def _need(condition: bool, kernel: str, message: str) -> None:
    if not condition:
        raise KernelContractError(f"stand-in glm_dsa_kernels_cpu, {kernel}: {message}")


def _dtype(kernel: str, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    _need(tensor.dtype == dtype, kernel, f"{name} must be {dtype} (the TileLang kernel's type), got {tensor.dtype}")


def indexer_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
) -> torch.Tensor:
    """``indexer_fwd_interface``: ``q [T, H, D]`` bf16, ``kv [T_kv, D]`` bf16, ``weights [T, H]`` fp32, windows
    ``[T]`` int32 -> logits ``[T, T_kv]`` fp32 (``-inf`` outside ``[ks, ke)``)."""
    kernel = "indexer_fwd_interface"
    _dtype(kernel, "index_q", q, torch.bfloat16)
    _dtype(kernel, "index_k", kv, torch.bfloat16)
    _dtype(kernel, "weights", weights, torch.float32)
    _dtype(kernel, "cu_seqlen_ks", cu_seqlen_ks, torch.int32)
    _dtype(kernel, "cu_seqlen_ke", cu_seqlen_ke, torch.int32)
    _need(q.dim() == 3 and kv.dim() == 2 and q.shape[-1] == kv.shape[-1], kernel, "q [T, H, D] and k [T_kv, D]")
    _need(tuple(weights.shape) == tuple(q.shape[:2]), kernel, f"weights {tuple(weights.shape)} != [T, H]")
    _need(cu_seqlen_ks.shape == q.shape[:1] and cu_seqlen_ke.shape == q.shape[:1], kernel, "cu_seqlen_ks / "
          f"cu_seqlen_ke must be [T] = [{q.shape[0]}], got {tuple(cu_seqlen_ks.shape)} / {tuple(cu_seqlen_ke.shape)}")  # fmt: skip
    _need(clean_logits, kernel, "clean_logits=False leaves logits outside the windows uninitialized")
    _STATE["calls"] += 1
    scores = torch.einsum("thd,jd->thj", q.float(), kv.float()).relu_()
    logits = torch.einsum("thj,th->tj", scores, weights)
    keys = torch.arange(kv.shape[0], device=kv.device)
    inside = (keys >= cu_seqlen_ks.long().unsqueeze(1)) & (keys < cu_seqlen_ke.long().unsqueeze(1))
    return logits.masked_fill(~inside, float("-inf"))


def indexer_bwd(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_k: torch.Tensor,
    topk_indices: torch.Tensor,
    grad_scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``indexer_bwd_interface``: gradients of ``score[t, i] = sum_h relu(q[t, h] . k[idx[t, i]]) * w[t, h]``
    for the valid slots (``0 <= idx < T_kv``). Returns ``grad_q`` (``index_q``'s dtype) ``[T, H, D]``, ``grad_w``
    fp32 ``[T, H]``, ``grad_k`` fp32 ``[T_kv, D]``."""
    _STATE["calls"] += 1
    q, k, w = index_q.float(), index_k.float(), weights.float()
    valid = (topk_indices >= 0) & (topk_indices < k.shape[0])
    keys = k[topk_indices.clamp(min=0, max=k.shape[0] - 1).long()]  # [T, K, D]
    grad = torch.where(valid, grad_scores.float(), torch.zeros_like(grad_scores, dtype=torch.float32))
    dots = torch.einsum("thd,tkd->thk", q, keys)
    grad_w = torch.einsum("tk,thk->th", grad, dots.relu())
    dlogits = torch.where(dots > 0, grad.unsqueeze(1) * w.unsqueeze(-1), torch.zeros_like(dots))  # [T, H, K]
    grad_q = torch.einsum("thk,tkd->thd", dlogits, keys).to(index_q.dtype)
    grad_keys = torch.einsum("thk,thd->tkd", dlogits, q)
    grad_k = torch.zeros_like(k).index_add_(
        0, topk_indices.clamp(min=0).long().flatten(), (grad_keys * valid.unsqueeze(-1)).flatten(0, 1)
    )
    return grad_q, grad_w, grad_k


def _check_sparse(kernel: str, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> None:
    _dtype(kernel, "q", q, torch.bfloat16)
    _dtype(kernel, "kv", kv, torch.bfloat16)
    _dtype(kernel, "indices", indices, torch.int32)
    _need(q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3, kernel, "q [T, H, C], kv [T_kv, G, C], indices "
          "[T, G, K]")  # fmt: skip
    _need(q.shape[-1] == QK_DIM and kv.shape[-1] == QK_DIM, kernel, f"dim_plus_tail_dim must be {QK_DIM} "
          f"(kv_lora_rank 512 + qk_rope_head_dim 64), got q {q.shape[-1]}, kv {kv.shape[-1]}")  # fmt: skip
    _need(kv.shape[1] == 1 and indices.shape[:2] == (q.shape[0], 1), kernel, "one KV group, indices [T, 1, K]")
    _need(indices.shape[-1] % BLOCK_I == 0, kernel, f"topk must be a multiple of {BLOCK_I} (index_topk), got "
          f"{indices.shape[-1]}")  # fmt: skip
    heads = q.shape[1]
    _need(heads <= 64 or heads % 64 == 0, kernel, f"heads > 64 must be a multiple of 64, got {heads}")


def _sparse_scores(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor):
    """Float32 ``(keys [T, K, 576], valid [T, K], scores [T, H, K])``: scores of every selected key, ``-inf`` at
    the ``-1`` sentinel."""
    flat = indices[:, 0].long()
    valid = flat >= 0
    keys = kv[:, 0].float()[flat.clamp(min=0)]
    scores = torch.einsum("thc,tkc->thk", q.float(), keys)
    return keys, valid, scores.masked_fill(~valid.unsqueeze(1), float("-inf"))


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float | None = None, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mla_fwd_interface``: ``q [T, H, 576]``, ``kv [T_kv, 1, 576]`` bf16, ``indices [T, 1, K]`` int32
    -> ``out [T, H, 512]`` bf16, ``lse [T, H]`` fp32 in base 2. ``sm_scale`` defaults to the kernel's
    ``576 ** -0.5``."""
    kernel = "sparse_mla_fwd_interface"
    _check_sparse(kernel, q, kv, indices)
    _need(options.get("d_v", LATENT_DIM) == LATENT_DIM and not options.get("return_p_sum", False), kernel,
          "only d_v=512 without return_p_sum")  # fmt: skip
    _STATE["calls"] += 1
    scale = QK_DIM**-0.5 if sm_scale is None else float(sm_scale)
    keys, _, scores = _sparse_scores(q, kv, indices)
    logits = scores * scale
    lse = torch.logsumexp(logits, dim=-1)  # natural log
    probs = torch.exp(logits - lse.unsqueeze(-1))
    out = torch.einsum("thk,tkd->thd", probs, keys[..., :LATENT_DIM])
    return out.to(torch.bfloat16), (lse / math.log(2.0)).float()


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float | None = None,
    is_casual: bool = True,
    return_kernel: bool = False,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mla_bwd``: from the saved ``o [T, H, 512]`` and base-2 ``lse [T, H]`` and ``do [T, H, 512]``,
    ``dq [T, H, 576]`` (``q``'s dtype) and ``dkv [T_kv, 1, 576]`` (``kv``'s dtype; accumulated in float32)."""
    kernel = "sparse_mla_bwd"
    _check_sparse(kernel, q, kv, indices)
    _need(not return_kernel, kernel, "return_kernel is not stood in")
    _STATE["calls"] += 1
    scale = QK_DIM**-0.5 if sm_scale is None else float(sm_scale)
    keys, valid, scores = _sparse_scores(q, kv, indices)
    probs = torch.exp2(scores * (scale * LOG2E) - lse.float().unsqueeze(-1))  # the kernel's saved-LSE recompute
    grad_out = do.float()
    if delta is None:
        delta = (o.float() * grad_out).sum(-1)  # the kernel's preprocess: [T, H]
    dprobs = torch.einsum("thd,tkd->thk", grad_out, keys[..., :LATENT_DIM])
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("thk,tkc->thc", dscores, keys)
    dkeys = torch.einsum("thk,thc->tkc", dscores, q.float())
    dkeys[..., :LATENT_DIM] += torch.einsum("thk,thd->tkd", probs, grad_out)
    dkeys = dkeys * valid.unsqueeze(-1)
    flat = indices[:, 0].long().clamp(min=0).flatten()
    dkv = torch.zeros(kv.shape[0], QK_DIM, dtype=torch.float32).index_add_(0, flat, dkeys.flatten(0, 1))
    return dq.to(q.dtype), dkv.unsqueeze(1).to(kv.dtype)


def _all_cpu_or_cuda(*tensors: torch.Tensor) -> bool:
    return all(tensor.device.type in ("cpu", "cuda") for tensor in tensors)


def _routes() -> list[tuple[Any, str, Any]]:
    optimized = importlib.import_module(OPTIMIZED)
    indexer = importlib.import_module(INDEXER)
    sparse = importlib.import_module(SPARSE_MLA)
    return [
        (optimized, "HAS_TILELANG", True),
        (optimized, "_all_cuda", _all_cpu_or_cuda),
        (indexer, "indexer_fwd_interface", indexer_fwd),
        (indexer, "indexer_bwd_interface", indexer_bwd),
        (sparse, "sparse_mla_fwd_interface", sparse_mla_fwd),
        (sparse, "sparse_mla_bwd", sparse_mla_bwd),
    ]


@contextlib.contextmanager
def install() -> Iterator[None]:
    """Route the four TileLang entry points to this module's torch computations and open the dispatch's
    availability / device check for the block; everything is back on exit (also after an exception). Raises if
    already installed."""
    if _STATE["installed"]:
        raise RuntimeError("stand-in glm_dsa_kernels_cpu is already installed (entered twice)")
    routes = _routes()
    saved = [(module, name, getattr(module, name)) for module, name, _ in routes]
    _STATE["installed"] = True
    try:
        for module, name, value in routes:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        _STATE["installed"] = False


def installed() -> bool:
    """Whether the stand-in's computations are the ones the framework calls now."""
    return bool(_STATE["installed"])


GLM_DSA_KERNELS_CPU = register(
    StandIn(
        name="glm_dsa_kernels_cpu",
        device_type="cpu",
        replaces="GLM-5.2 DSA's TileLang kernels (kernels/indexer.py's indexer_fwd_interface / indexer_bwd_interface, "
        "kernels/sparse_mla.py's sparse_mla_fwd_interface / sparse_mla_bwd)",
        role="DSA lighting-indexer and sparse-MLA kernels",
        computes_with="torch on the CPU (float32 relu(q.k)*w logits in the key windows; gathered top-k softmax "
        "attention with base-2 LSE and its saved-LSE backward)",
        meets="cuda",
        install=install,
        calls=lambda: _STATE["calls"],
        reference_too=True,
    )
)
