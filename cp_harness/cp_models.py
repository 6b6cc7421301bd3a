"""The miniature models as one CP rank runs them, through the documented API only.

These are how a model *uses* the CP modules (see ``docs/miniature_models.md``):
local queries against keys and values gathered with ``gather_sequence`` /
``gather_tokens``, a causal convolution fed by ``convolution_history``, image
splicing on global embeddings followed by ``shard_token_tensor``, and the
shifted loss through ``shifted_cp_loss``. Everything that is judged comes from
the implementation under test (``impl``); the element-wise pieces (norm,
rotary embedding, patch projection) are shared with the oracle because they
are not what CP changes.

Shapes: ``B`` batch, ``S`` global sequence, ``L`` local sequence
(``S_padded / N``), ``D`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from oracle import models as oracle_models
from oracle.attention import rotary_embedding


@dataclasses.dataclass
class CPModelOutput:
    """One rank's results.

    ``inputs_embeds``: local input embeddings ``[B, L, D]`` (gradients retained),
    ``logits``: local ``[B, L, V]``, ``loss``: this rank's loss, already scaled
    so that averaging gradients over the CP ranks gives the gradient of the
    global mean loss, ``local_batch``: the sharded batch.
    """

    inputs_embeds: torch.Tensor
    logits: torch.Tensor
    loss: torch.Tensor
    local_batch: dict[str, Any]
    cp_size: int
    cp_rank: int
    local_len: int


def _mesh_rank_size(mesh) -> tuple[int, int]:
    if mesh is None:
        return 0, 1
    return mesh.get_local_rank(), mesh.size()


def _bind(sharder, mesh):
    """The one documented way to bind a sharder returned by a hook to a CP mesh."""
    return sharder.bind(mesh)


def _local_attention(q, k_all, v_all, keep, positions, first_global, *, window=None):
    """Local queries ``[B,L,Hq,Dh]`` against gathered keys/values ``[B,S_pad,Hkv,Dh]``.

    Query ``i`` (global index ``first_global + t``) attends key ``j`` iff it is
    kept, ``i - positions[i] <= j <= i`` and, with a window, ``i - j < window``.
    In a validated row the tokens from a document's start to ``i`` are all real
    and of ``i``'s document, so no key-side mask (and no gather of one) is
    needed; wrong positions from the implementation show as wrong outputs.
    Padding query rows give exactly zero.
    """
    B, L, Hq, Dh = q.shape
    S = k_all.shape[1]
    groups = Hq // k_all.shape[2]
    k_all = k_all.repeat_interleave(groups, dim=2)
    v_all = v_all.repeat_interleave(groups, dim=2)
    i = first_global + torch.arange(L, device=q.device)
    j = torch.arange(S, device=q.device)
    allowed = (j[None, None, :] <= i[None, :, None]) & (j[None, None, :] >= (i[None, :] - positions)[:, :, None])
    allowed = allowed & keep[:, :, None]
    if window is not None:
        allowed = allowed & ((i[None, :, None] - j[None, None, :]) < window)
    has_key = allowed.any(dim=-1, keepdim=True)
    safe = allowed | ~has_key  # rows with no key (padding) attend everything harmlessly, then are zeroed
    scores = torch.einsum("blhd,bshd->bhls", q, k_all) * (Dh ** -0.5)
    scores = scores.masked_fill(~safe[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhls,bshd->blhd", probs, v_all)
    return out * keep[:, :, None, None].to(out.dtype)


def _masked_input(x0: torch.Tensor, local: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Retain the gradient of the local input embeddings ``x0 [B,L,D]``; return the implementation's
    local ``keep`` and ``position_ids [B,L]`` and ``x0`` with padding rows zeroed."""
    x0.retain_grad()
    keep = ~local["padding_mask"]
    return keep, local["position_ids"], x0 * keep[..., None].to(x0.dtype)


def _global_embeddings(params, config, batch) -> torch.Tensor:
    """Token embeddings of the global ``input_ids [B,S]`` with image features spliced in: ``[B,S,D]``."""
    embeds = params["embed"][batch["input_ids"]]
    if batch.get("image_mask") is not None and batch.get("pixel_values") is not None:
        features = oracle_models.image_features(params, config, batch["pixel_values"])
        embeds = oracle_models.splice_image_features(embeds, features, batch["image_mask"])
    return embeds


def _gather_kv(gather, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B,L,Hkv,Dh]`` travel in one differentiable gather, as a model would send its KV."""
    kv = gather(torch.cat([k, v], dim=-1))
    return kv[..., :k.shape[-1]], kv[..., k.shape[-1]:]


def _count_all_reduce(count: torch.Tensor, mesh) -> torch.Tensor:
    """Global number of counted labels (the training recipe's reduction, not part of the API under test)."""
    if mesh is None or mesh.size() == 1:
        return count
    count = count.clone()
    dist.all_reduce(count, group=mesh.get_group())
    return count


def inkling2_cp_forward(impl, params: dict[str, torch.Tensor], config, batch: dict[str, Any], mesh, *,
                        num_chunks: int = 1) -> CPModelOutput:
    """Inkling2-mini on one CP rank. ``batch`` is the global batch (every rank gets the same); it is normalised in place as the hooks document."""
    ink = impl.inkling2
    sharder = _bind(ink.prepare_cp_inputs(batch, num_chunks=num_chunks)["cp_sharder"], mesh)
    ctx_factory, local = sharder.shard(batch)
    rank, size = _mesh_rank_size(mesh)
    with ctx_factory():
        x0 = sharder.shard_token_tensor(_global_embeddings(params, config, local))
        keep, positions, x = _masked_input(x0, local)
        L = x0.shape[1]

        W = config.conv_width
        history = ink.convolution_history(x, mesh, W)  # [B, L + W - 1, D]
        conv = torch.zeros_like(x)
        for k in range(W):
            tap_ok = (k <= positions) & keep  # same document and kept, for a validated row
            conv = conv + params["conv_weight"][k] * history[:, W - 1 - k: W - 1 - k + L] * tap_ok[..., None].to(x.dtype)
        x = x + F.silu(conv) @ params["conv_out"]

        a = oracle_models.rms_norm(x, params["norm1"])
        q = rotary_embedding((a @ params["wq"]).unflatten(-1, (config.num_heads, config.head_dim)), positions, config.rope_base)
        k = rotary_embedding((a @ params["wk"]).unflatten(-1, (config.num_kv_heads, config.head_dim)), positions, config.rope_base)
        v = (a @ params["wv"]).unflatten(-1, (config.num_kv_heads, config.head_dim))
        k_all, v_all = _gather_kv(lambda t: ink.gather_sequence(t, mesh, True), k, v)
        attn = _local_attention(q, k_all, v_all, keep, positions, rank * L)
        x = x + attn.flatten(-2) @ params["wo"]
        logits = (oracle_models.rms_norm(x, params["norm2"]) @ params["lm_head"]) * keep[..., None].to(x.dtype)

    # The recipe's loss: aligned labels, local sum x N / global count.
    labels = local["labels"]
    counted = keep & (labels != -100)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    local_sum = -(picked * counted.to(picked.dtype)).sum()
    count = _count_all_reduce(counted.sum().to(torch.int64), mesh)
    loss = local_sum * size / count if int(count) > 0 else local_sum * 0.0
    return CPModelOutput(x0, logits, loss, local, size, rank, L)


def _gather_tokens_bshd(gather_tokens, value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``gather_tokens`` works on ``[tokens, ...]``: move the sequence first, gather, move it back."""
    return gather_tokens(value.transpose(0, 1).contiguous(), mesh, differentiable).transpose(0, 1)


def mistral_large4_cp_forward(impl, params: dict[str, torch.Tensor], config, batch: dict[str, Any], mesh, *,
                              num_chunks: int = 1, shard_primary: bool = True) -> CPModelOutput:
    """MistralLarge4-mini on one CP rank; packed batches go through the same hook (it dispatches to the packed path)."""
    ml = impl.mistral_large4
    sharder = _bind(ml.prepare_cp_inputs(batch, num_chunks=num_chunks, shard_primary=shard_primary)["cp_sharder"], mesh)
    ctx_factory, local = sharder.shard(batch)
    rank, size = _mesh_rank_size(mesh)
    with ctx_factory():
        has_image = local.get("image_mask") is not None and local.get("pixel_values") is not None
        if shard_primary:
            x0 = params["embed"][local["input_ids"]]
            if has_image:
                # Splice on the local slice: which feature lands where is decided on the global mask.
                features = oracle_models.image_features(params, config, local["pixel_values"])
                image_mask = local["image_mask"]
                index = (torch.cumsum(image_mask.flatten().to(torch.int64), 0) - 1).view_as(image_mask)
                local_mask = sharder.shard_token_tensor(image_mask, pad_value=False)
                local_index = sharder.shard_token_tensor(index.clamp(min=0))
                x0 = torch.where(local_mask[..., None], features[local_index], x0)
        else:
            x0 = sharder.shard_token_tensor(_global_embeddings(params, config, local))
        keep, positions, x = _masked_input(x0, local)
        L = x0.shape[1]
        for i in range(2):
            p = f"blocks.{i}."
            a = oracle_models.rms_norm(x, params[p + "norm"])
            q = rotary_embedding((a @ params[p + "wq"]).unflatten(-1, (config.num_heads, config.head_dim)), positions, config.rope_base)
            k = rotary_embedding((a @ params[p + "wk"]).unflatten(-1, (config.num_kv_heads, config.head_dim)), positions, config.rope_base)
            v = (a @ params[p + "wv"]).unflatten(-1, (config.num_kv_heads, config.head_dim))
            k_all, v_all = _gather_kv(lambda t: _gather_tokens_bshd(ml.gather_tokens, t, mesh, True), k, v)
            window = None if i == 0 else config.sliding_window
            attn = _local_attention(q, k_all, v_all, keep, positions, rank * L, window=window)
            x = x + attn.flatten(-2) @ params[p + "wo"]
        raw = oracle_models.rms_norm(x, params["final_norm"]) @ params["lm_head"]
        cap = config.logit_softcap
        logits = cap * torch.tanh(raw / cap) * keep[..., None].to(raw.dtype)
    loss = ml.shifted_cp_loss(logits, local["labels"], keep.flatten(), mesh)
    return CPModelOutput(x0, logits, loss, local, size, rank, L)
