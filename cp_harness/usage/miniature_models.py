"""The miniature models as one CP rank runs them, through the documented API only.

These are how a model *uses* the CP modules (see ``docs/miniature_models.md``):
local queries against keys and values gathered with ``gather_sequence`` /
``gather_tokens``, a causal convolution fed by ``convolution_history``, image
splicing on global embeddings followed by ``shard_token_tensor``, and the
shifted loss through ``shifted_cp_loss``. Everything that is judged comes from
the implementation under test (``impl``); the element-wise pieces (norm,
rotary embedding, patch projection) are shared with the oracle because they
are not what CP changes.

The sharder a hook returns is resolved the framework's way
(``cp_harness.usage.resolve_sharder``), and where each local token sits is read from its
index map, so any layout works: attention masks use the global positions of
queries and (gathered) keys. ``convolution_history`` and ``shifted_cp_loss``
are defined for contiguous shards in rank order (the halo is "the ``W-1`` rows
before this shard"; "the target of a shard's last position comes from the
next rank"): the models call them when the layout is contiguous, and for any
other index map build the halo and the shifted targets from differentiable
gathers in global order, as a model on such a layout would.

Shapes: ``B`` batch, ``S`` global sequence, ``L`` local sequence
(``S_padded / N``), ``D`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_harness.usage.resolve_sharder import hook_sharder, local_token_indices, sharded
from oracle import models as oracle_models
from oracle.attention import rotary_embedding


@dataclasses.dataclass
class CPModelOutput:
    """One rank's results.

    ``inputs_embeds``: local input embeddings ``[B, L, D]`` (gradients retained),
    ``logits``: local ``[B, L, V]``, ``loss``: this rank's loss, already scaled
    so that averaging gradients over the CP ranks gives the gradient of the
    global mean loss, ``local_batch``: the sharded batch, ``sharder``: the
    resolved sharder, ``positions``: the :class:`TokenPositions` of the layout, ``caller_changes``: the caller's
    tensors ``shard()`` changed in place, by key (``sharding.sharded``).
    """

    inputs_embeds: torch.Tensor
    logits: torch.Tensor
    loss: torch.Tensor
    local_batch: dict[str, Any]
    cp_size: int
    cp_rank: int
    local_len: int
    sharder: Any
    positions: TokenPositions
    caller_changes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TokenPositions:
    """Where tokens sit: ``local [L]`` global positions of this rank's tokens, ``gathered [N*L]`` those of every
    rank's tokens in rank order (what a gather returns), ``order [N*L]`` the permutation that puts gathered
    tokens in global order, ``contiguous``: rank ``r`` owns ``[r*L, (r+1)*L)`` (the same answer on every rank)."""

    local: torch.Tensor
    gathered: torch.Tensor
    order: torch.Tensor
    contiguous: bool

    def global_order(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A gathered ``[.., N*L, ..]`` tensor (rank order) in global token order."""
        return gathered.index_select(dim, self.order)


def _token_positions(sharder, mesh, local_len: int, gather_1d, device) -> TokenPositions:
    """The layout's index map on this rank and, through the implementation's gather (no autograd), on all."""
    local = local_token_indices(sharder, mesh, local_len, device)
    gathered = gather_1d(local)
    order = torch.argsort(gathered)
    contiguous = bool(torch.equal(gathered, torch.arange(gathered.numel(), device=gathered.device)))
    return TokenPositions(local, gathered, order, contiguous)


def _mesh_rank_size(mesh) -> tuple[int, int]:
    if mesh is None:
        return 0, 1
    return mesh.get_local_rank(), mesh.size()


def _local_attention(
    q,
    k_all,
    v_all,
    keep,
    positions,
    token_positions: TokenPositions,
    *,
    window=None,
    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Local queries ``[B,L,Hq,Dh]`` against gathered keys/values ``[B,N*L,Hkv,Dh]`` (rank order).

    Query ``i`` (global index ``token_positions.local[t]``) attends key ``j``
    (global index ``token_positions.gathered[s]``) iff it is kept,
    ``i - positions[i] <= j <= i`` and, with a window, ``i - j < window``.
    In a validated row the tokens from a document's start to ``i`` are all real
    and of ``i``'s document, so no key-side mask (and no gather of one) is
    needed; wrong positions from the implementation show as wrong outputs.
    ``documents``: ``(local document ids [B,L], gathered ones [B,N*L])`` of packed rows, read as a packed
    attention kernel reads them (a key of another document is masked), so document ids that are not sharded
    like the tokens show as wrong outputs or a failing gather. Padding query rows give exactly zero.
    """
    B, L, Hq, Dh = q.shape
    groups = Hq // k_all.shape[2]
    k_all = k_all.repeat_interleave(groups, dim=2)
    v_all = v_all.repeat_interleave(groups, dim=2)
    i = token_positions.local
    j = token_positions.gathered
    allowed = (j[None, None, :] <= i[None, :, None]) & (j[None, None, :] >= (i[None, :] - positions)[:, :, None])
    allowed = allowed & keep[:, :, None]
    if documents is not None:
        query_docs, key_docs = documents
        allowed = allowed & (query_docs[:, :, None] == key_docs[:, None, :])
    if window is not None:
        allowed = allowed & ((i[None, :, None] - j[None, None, :]) < window)
    has_key = allowed.any(dim=-1, keepdim=True)
    safe = allowed | ~has_key  # rows with no key (padding) attend everything harmlessly, then are zeroed
    scores = torch.einsum("blhd,bshd->bhls", q, k_all) * (Dh**-0.5)
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
    return kv[..., : k.shape[-1]], kv[..., k.shape[-1] :]


def _count_all_reduce(count: torch.Tensor, mesh) -> torch.Tensor:
    """Global number of counted labels (the training recipe's reduction, not part of the API under test)."""
    if mesh is None or mesh.size() == 1:
        return count
    count = count.clone()
    dist.all_reduce(count, group=mesh.get_group())
    return count


def _recipe_loss(logits: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor, mesh, size: int) -> torch.Tensor:
    """The training recipe's loss on aligned targets: local sum of cross-entropy over ``counted [B,L]`` x N / global count."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    local_sum = -(picked * counted.to(picked.dtype)).sum()
    count = _count_all_reduce(counted.sum().to(torch.int64), mesh)
    return local_sum * size / count if int(count) > 0 else local_sum * 0.0


def _next_token_targets(
    labels: torch.Tensor, keep: torch.Tensor, where: TokenPositions, gather_rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF shifted targets on any layout: the label and keep flag at global position ``p+1`` for each local token.

    ``labels``/``keep [B,L]`` local; ``gather_rows``: ``[B,L]`` to ``[B,N*L]`` in rank order (no autograd).
    Returns ``(targets [B,L], next_kept [B,L])``; the global last position has no target.
    """
    glabels = where.global_order(gather_rows(labels))
    gkeep = where.global_order(gather_rows(keep.to(torch.int64))).bool()
    nxt = where.local + 1
    has_next = nxt < glabels.shape[1]
    nxt = nxt.clamp(max=glabels.shape[1] - 1)
    targets = torch.where(has_next, glabels.index_select(1, nxt), torch.full_like(labels, -100))
    next_kept = gkeep.index_select(1, nxt) & has_next
    return targets, next_kept


def inkling2_cp_forward(
    impl, params: dict[str, torch.Tensor], config, batch: dict[str, Any], mesh, *, num_chunks: int = 1
) -> CPModelOutput:
    """Inkling2-mini on one CP rank. ``batch`` is the global batch (every rank gets the same); it is normalised in place as the hooks document."""
    ink = impl.inkling2
    caller = dict(batch)
    sharder = hook_sharder(ink.prepare_cp_inputs(batch, num_chunks=num_chunks), mesh)
    rank, size = _mesh_rank_size(mesh)
    with sharded(sharder, batch, caller=caller) as shard:
        local = shard.local
        x0 = sharder.shard_token_tensor(_global_embeddings(params, config, local), fill=0)
        keep, positions, x = _masked_input(x0, local)
        L = x0.shape[1]
        where = _token_positions(sharder, mesh, L, lambda t: ink.gather_sequence(t[None], mesh, False)[0], x.device)

        W = config.conv_width
        if where.contiguous:
            history = ink.convolution_history(x, mesh, W)  # [B, L + W - 1, D]
            tap = lambda k: history[:, W - 1 - k : W - 1 - k + L]  # noqa: E731 - input at global position p - k
        else:  # the halo of each local token from the whole sequence, gathered in global order
            x_global = where.global_order(ink.gather_sequence(x, mesh, True))
            tap = lambda k: x_global.index_select(1, (where.local - k).clamp(min=0))  # noqa: E731
        conv = torch.zeros_like(x)
        for lag in range(W):
            tap_ok = (lag <= positions) & keep  # same document and kept, for a validated row
            conv = conv + params["conv_weight"][lag] * tap(lag) * tap_ok[..., None].to(x.dtype)
        x = x + F.silu(conv) @ params["conv_out"]

        a = oracle_models.rms_norm(x, params["norm1"])
        q = rotary_embedding(
            (a @ params["wq"]).unflatten(-1, (config.num_heads, config.head_dim)), positions, config.rope_base
        )
        k = rotary_embedding(
            (a @ params["wk"]).unflatten(-1, (config.num_kv_heads, config.head_dim)), positions, config.rope_base
        )
        v = (a @ params["wv"]).unflatten(-1, (config.num_kv_heads, config.head_dim))
        k_all, v_all = _gather_kv(lambda t: ink.gather_sequence(t, mesh, True), k, v)
        attn = _local_attention(q, k_all, v_all, keep, positions, where)
        x = x + attn.flatten(-2) @ params["wo"]
        logits = (oracle_models.rms_norm(x, params["norm2"]) @ params["lm_head"]) * keep[..., None].to(x.dtype)

        # The recipe's loss, as the framework's MaskedCrossEntropy computes it: aligned labels masked on the label
        # value alone (-100), local sum x N / global count. A sharder that pads labels with anything but -100
        # changes this loss.
        labels = local["labels"]
        loss = _recipe_loss(logits, labels, labels != -100, mesh, size)
    return CPModelOutput(x0, logits, loss, local, size, rank, L, sharder, where, shard.caller_changes)


def _gather_tokens_bshd(gather_tokens, value: torch.Tensor, mesh, differentiable: bool) -> torch.Tensor:
    """``gather_tokens`` works on ``[tokens, ...]``: move the sequence first, gather, move it back."""
    return gather_tokens(value.transpose(0, 1).contiguous(), mesh, differentiable).transpose(0, 1)


def mistral_large4_cp_forward(
    impl,
    params: dict[str, torch.Tensor],
    config,
    batch: dict[str, Any],
    mesh,
    *,
    num_chunks: int = 1,
    shard_primary: bool = True,
) -> CPModelOutput:
    """MistralLarge4-mini on one CP rank; packed batches go through the same hook (it dispatches to the packed path)."""
    ml = impl.mistral_large4
    caller = dict(batch)
    sharder = hook_sharder(ml.prepare_cp_inputs(batch, num_chunks=num_chunks, shard_primary=shard_primary), mesh)
    rank, size = _mesh_rank_size(mesh)
    with sharded(sharder, batch, caller=caller) as shard:
        local = shard.local
        has_image = local.get("image_mask") is not None and local.get("pixel_values") is not None
        if shard_primary:
            x0 = params["embed"][local["input_ids"]]
            if has_image:
                # Splice on the local slice: which feature lands where is decided on the global mask.
                features = oracle_models.image_features(params, config, local["pixel_values"])
                image_mask = local["image_mask"]
                index = (torch.cumsum(image_mask.flatten().to(torch.int64), 0) - 1).view_as(image_mask)
                local_mask = sharder.shard_token_tensor(image_mask, fill=False)
                local_index = sharder.shard_token_tensor(index.clamp(min=0), fill=0)
                x0 = torch.where(local_mask[..., None], features[local_index], x0)
        else:
            x0 = sharder.shard_token_tensor(_global_embeddings(params, config, local), fill=0)
        keep, positions, x = _masked_input(x0, local)
        L = x0.shape[1]
        where = _token_positions(sharder, mesh, L, lambda t: ml.gather_tokens(t, mesh, False), x.device)
        documents = None
        if local.get("document_ids") is not None:  # packed rows: the attention reads document ids, as packed kernels do
            docs = local["document_ids"]
            documents = (docs, _gather_tokens_bshd(ml.gather_tokens, docs, mesh, False))
        for i in range(2):
            p = f"blocks.{i}."
            a = oracle_models.rms_norm(x, params[p + "norm"])
            q = rotary_embedding(
                (a @ params[p + "wq"]).unflatten(-1, (config.num_heads, config.head_dim)), positions, config.rope_base
            )
            k = rotary_embedding(
                (a @ params[p + "wk"]).unflatten(-1, (config.num_kv_heads, config.head_dim)),
                positions,
                config.rope_base,
            )
            v = (a @ params[p + "wv"]).unflatten(-1, (config.num_kv_heads, config.head_dim))
            k_all, v_all = _gather_kv(lambda t: _gather_tokens_bshd(ml.gather_tokens, t, mesh, True), k, v)
            window = None if i == 0 else config.sliding_window
            attn = _local_attention(q, k_all, v_all, keep, positions, where, window=window, documents=documents)
            x = x + attn.flatten(-2) @ params[p + "wo"]
        raw = oracle_models.rms_norm(x, params["final_norm"]) @ params["lm_head"]
        cap = config.logit_softcap
        logits = cap * torch.tanh(raw / cap) * keep[..., None].to(raw.dtype)
        if where.contiguous:
            loss = ml.shifted_cp_loss(logits, local["labels"], keep.flatten(), mesh)
        else:
            gather_rows = lambda t: _gather_tokens_bshd(ml.gather_tokens, t, mesh, False)  # noqa: E731
            # What shifted_cp_loss computes on contiguous shards (the contract: a position counts when it and the
            # next one are valid and the next label is not -100), on any layout.
            targets, next_kept = _next_token_targets(local["labels"], keep, where, gather_rows)
            loss = _recipe_loss(logits, targets, keep & next_kept & (targets != -100), mesh, size)
    return CPModelOutput(x0, logits, loss, local, size, rank, L, sharder, where, shard.caller_changes)
