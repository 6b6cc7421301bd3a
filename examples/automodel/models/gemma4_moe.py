"""Model spec: nemo-automodel 0.7.0's Gemma4 MoE (``Gemma4ForConditionalGeneration`` with ``enable_moe_block``)
at a tiny random config, CP the framework's way: contiguous shards and Gemma4's own p2p ring attention.

The interface is ``_base``'s (see its docstring for every function and shape); this module documents
what differs. Shapes: ``B`` rows, ``S`` global sequence, ``S_local`` this rank's shard, ``V`` vocabulary.

CP machinery (model-owned, ``_owns_cp_attention``): ``prepare_model_inputs_for_cp`` returns a
``ContextParallelSharder`` whose ``shard_batch`` (``_cp_shard_batch_aux_only``) pads every stream to a
multiple of ``2 x cp`` and keeps one contiguous slice per rank of the *auxiliary* streams only (``labels``,
``position_ids``, ``padding_mask``, the document map ``_packed_seq_ids``, synthesized for unpacked rows);
``input_ids`` stays full length and the forward embeds the whole row and slices it
(``shard_sequence_for_cp_contiguous``). Each attention layer swaps ``F.scaled_dot_product_attention`` for a
ring (``_Gemma4FlexRingAttention``): K/V and the mask metadata rotate rank to rank over
``batch_isend_irecv`` (``_ring_exchange``), each received chunk is attended with FlexAttention under a
local-query/global-key mask (causal, sliding window, document, padding, vision groups) and merged by its
log-sum-exp (``_merge_flex_chunk``). Sliding layers collect ``ceil(window / S_local)`` prior chunks, full
layers (and any layer when vision metadata is present) all ``cp - 1``. Backward (on CPU through the
``flex_backward_cpu`` stand-in) recomputes the chunks, and sends each owner's dK/dV back to it
(``_route_kv_grads_to_owners``, p2p).

How the spec enters CP: as a run with ``ep_size > 1`` does (the Gemma4 MoE recipes run EP 8): the framework's
``apply_cp`` (``model_owned_cp.apply_moe_cp``) installs the ring on every attention module, then the
recipe's ``ContextParallelSharder(model, mesh, batch)`` + ``shard(batch)``; the sharder's own
``setup_cp_attention`` call is then a no-op, as in training. It does so on a CP twin of the model
(``model_owned_cp.cp_twin``: same parameters, own modules), because the install is permanent.

One-device reference: the untouched model through the identity sharder, attention ``eager`` (what the Gemma4
MoE recipes set; CP forces ``sdpa``, which the ring replaces). Packed batches are collated as the VLM
loader does at ``cp_size <= 1`` (``neat_packed_vlm_collater(materialize_4d_mask=True)``: a ``[B, 1, S, S]``
block-causal ``attention_mask``, ``_packed_seq_ids`` only when some row holds two or more documents); the
CP path gets the loader's ``cp_size > 1`` form (the indexed ``[B, S]`` mask and ``_packed_seq_ids``), which is
what ``make_batch`` returns. (``collate_fns`` itself cannot be imported without the ``datasets`` package,
which the pinned set does not hold, so ``one_device_batch`` applies those lines of it.) Two one-device
findings follow (``docs/models/gemma4_moe.md``, repro ``repro/models/gemma4_packed_masks.py``), and such cases fail:
G1, rows that are all single documents lose the sliding window (any attention); G2, with ``eager`` attention
packs of two or more documents get no masking at all. ``overrides={"attn_implementation": "sdpa"}`` removes
G2 (the CP path does not depend on it).

On CPU the twin's FlexAttention runs uncompiled (``_gemma4_cp_compiled_flex_attn``, the framework's per-module
compile cache; see ``model_owned_cp.flex_attention_eager`` for the two inductor errors) and its backward runs
through the ``flex_backward_cpu`` stand-in (``STANDINS``; without it: ``FORWARD_ONLY_WITHOUT_STANDIN``).
``cp_kernels`` (the check's kernel-sensitivity run) computes the one-device attention with that same kernel under
the one-device mask: finding M5 (G3 bfloat16, G4 a mathematically zero float32 gradient) is reported through it.

Batch keys: plain and right-padded batches are ``_base``'s (``input_ids``, ``labels``, optional
``attention_mask`` 1/0). Packed rows (``documents`` per row, concatenated from column 0): ``input_ids``,
``labels`` (shifted within each document, -100 on its last token and on padding), ``attention_mask``
``[B, S]`` (document index 1.., 0 padding), ``position_ids`` (document-local, 0 on padding),
``mm_token_type_ids`` (0: text), ``_packed_seq_ids`` (= ``attention_mask``).

Tiny config (``TINY``): hidden 16, 4 layers ``[sliding, full, sliding, full]``, sliding window 4, 2 query
heads and 1 KV head of 8 (sliding) / 16 (full, ``attention_k_eq_v``: V is K), MoE with 4 experts (2 active)
beside the dense MLP in every layer, vocabulary 64, final logit soft-cap 30, ``use_bidirectional_attention=
"vision"`` (as the released Gemma 4 configs), no vision/audio tower, no per-layer inputs, tied embeddings.
The FFPA (head_dim 512, CUDA) and FlashAttention sliding kernels are not selected (``cp_*_attn_backend``
default ``flex``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from nemo_automodel.components.datasets.utils import _indexed_mask_to_4d_block_causal
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.gemma4_moe.model import Gemma4Config, Gemma4ForConditionalGeneration

from examples.automodel.models import _base, model_owned_cp
from examples.automodel.models._base import *  # noqa: F403  (re-exported: same verbs, same semantics)
from examples.automodel.models._base import pad_batch  # noqa: F401

NAME = "gemma4_moe"
FRAMEWORK_CLASS = "nemo_automodel.components.models.gemma4_moe.model.Gemma4ForConditionalGeneration"
WORLD_SIZES = (1, 2, 3)  # CP 4 and above never run (3 ranks at most on the machine these were measured on)
BATCH_KINDS = ("plain", "right_padded", "packed")

_RING_ATTENTION: dict[str, str] = {  # the ring's half of COVERS (in the forward, per attention call)
    "nemo_automodel.components.models.gemma4_moe.cp_attention._gemma4_cp_manual_attention": "builds the ring context from the captured metadata",
    "nemo_automodel.components.models.gemma4_moe.cp_attention._Gemma4FlexRingAttention.forward": "the ring's autograd function (forward)",
    "nemo_automodel.components.models.gemma4_moe.cp_attention._collect_ring_kv_chunks": "rotates K/V and metadata around the ring",
    "nemo_automodel.components.models.gemma4_moe.cp_attention._direct_exchange": "batch_isend_irecv to cp_rank + 1, from cp_rank - 1",
    "nemo_automodel.components.models.gemma4_moe.cp_attention._run_gemma4_flex_chunk": "one chunk: local-query/global-key block mask, FlexAttention with LSE",
    "nemo_automodel.components.models.gemma4_moe.cp_attention._merge_flex_chunk": "log-sum-exp merge of the chunk outputs",
}

STANDINS = ("flex_backward_cpu",)  # lifts the CPU refusal below; docs/standins.md
FORWARD_ONLY_ON: dict[str, str] = {}
FORWARD_ONLY_WITHOUT_STANDIN = {  # what the CPU gives without the stand-in (tests' forward-only fixtures)
    "cpu": "torch 2.13 has no FlexAttention backward on CPU: in a training step the ring's forward already raises "
    "'RuntimeError: Gemma4 CP ring requires FlexAttention for local-query/ring-KV attention. FlexAttention "
    "failed for Q=(1, 2, 8, 8) K=(1, 1, 8, 8) V=(1, 1, 8, 8) cp_rank=0 seq_local=8 kv_global_start=0.' from "
    "'NotImplementedError: FlexAttention does not support backward on CPU. Please set the input "
    "requires_grad to False or use another device.' (torch/nn/attention/flex_attention.py "
    "_validate_device); without grad the compiled kernel raises 'torch.compile on CPU only supports "
    "inference and `return_lse` is not supported yet', so on CPU the forward runs under torch.no_grad() "
    "with FlexAttention uncompiled",
}

COVERS: dict[str, str] = {
    "nemo_automodel.components.moe.parallelizer.apply_cp": "sets the CP flags and mesh, calls every attention module's setup_cp_attention",
    "nemo_automodel.components.models.gemma4_moe.cp_attention._install_gemma4_cp_ring_sdpa": "installs the pre/post hooks that swap F.scaled_dot_product_attention for the ring per attention call",
    "nemo_automodel.components.models.gemma4_moe.model.Gemma4ForConditionalGeneration.prepare_model_inputs_for_cp": "returns the model-owned contiguous sharder",
    "nemo_automodel.components.models.gemma4_moe.model.Gemma4ForConditionalGeneration._cp_shard_batch_aux_only": "the sharder's shard_batch: records cp_mesh, shards the auxiliary streams",
    "nemo_automodel.components.models.gemma4_moe.cp_batch.make_contiguous_aux_only_shard_cp_batch_and_ctx": "attention_mask -> padding_mask, synthesizes _packed_seq_ids for unpacked rows",
    "nemo_automodel.components.distributed.context_parallel.sharder.shard_batch_contiguous": "pads to 2 x cp, slices labels / position_ids / padding_mask / _packed_seq_ids per rank",
    "nemo_automodel.components.models.gemma4_moe.model.Gemma4ForConditionalGeneration._cp_sunk_prepare_inputs": "embeds the full row, slices embeddings and mm_token_type_ids / vision-group ids per rank",
    "nemo_automodel.components.distributed.context_parallel.sharder.shard_sequence_for_cp_contiguous": "pads and slices the embeddings (differentiable index_select)",
    **_RING_ATTENTION,
    **_base.COVERS_GATHER_TRIMMED,
}

# fmt: off
BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch",
               fake_balanced_gate=False, enable_hf_state_dict_adapter=False)
ONE_DEVICE_ATTENTION = "eager"

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], sliding_window=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
    attention_k_eq_v=True, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=64, use_bidirectional_attention="vision",
    final_logit_softcapping=30.0, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0, use_cache=False,
)
# fmt: on

BATCH_KEYS: dict[str, dict[str, str]] = {
    "required": _base.BATCH_KEYS["required"],
    "optional": {
        "attention_mask": "[B, S] 1 real / 0 padding (right padding), or document index 1.. / 0 (packed rows)",
        "position_ids": "[B, S] int64 (document-local in packed rows)",
        "mm_token_type_ids": "[B, S] int64 0 text (packed rows, as the VLM collater emits them)",
        "_packed_seq_ids": "[B, S] document index 1.. / 0 padding (packed rows)",
    },
    "produced_by_sharder": {
        "padding_mask": "[B, S_local] bool, True on padding (CP)",
        "_packed_seq_ids": "[B, S_local] (CP; synthesized for unpacked rows: 1 real, 0 padding)",
    },
}


def config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Gemma4Config:
    """The framework's config for the tiny model (``TINY`` with ``overrides``) in ``dtype``, text only.

    ``overrides["attn_implementation"]`` (default ``ONE_DEVICE_ATTENTION``) selects the HF attention of the
    one-device path; every other key replaces a text-config field.
    """
    name = _base.dtype_name(NAME, dtype)
    overrides = dict(overrides)
    attention = overrides.pop("attn_implementation", ONE_DEVICE_ATTENTION)
    text = {**_base.tiny(TINY, overrides), "dtype": name}
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None, dtype=name)
    cfg._attn_implementation = attention
    cfg.text_config._attn_implementation = attention
    return cfg


def build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The tiny model on CPU in ``train()`` mode with seeded random weights (same on every rank)."""
    cfg = config(dtype, **overrides)
    return _base.build_seeded(
        lambda: Gemma4ForConditionalGeneration(cfg, backend=BackendConfig(**BACKEND)), dtype, seed
    )


def _enter_cp(twin: torch.nn.Module, cp_mesh: Any) -> None:
    model_owned_cp.apply_moe_cp(twin, cp_mesh)
    if next(twin.parameters()).device.type == "cpu":
        flex = model_owned_cp.flex_attention_eager()
        for module in twin.modules():
            if hasattr(module, "_gemma4_cp_sliding_backend"):  # set by attach_gemma4_cp_ring_attention
                module._gemma4_cp_compiled_flex_attn = flex  # type: ignore[assignment]  # a function, not a Module


CP_KERNELS = (
    "attention by FlexAttention's dense path (the kernel of Gemma4's CP ring, _run_gemma4_flex_chunk: float32 scores "
    "and softmax, natural-log LSE, FlexAttention's backward) under the one-device mask, instead of HF eager attention"
)


def _flex_attention_under_mask(
    flex: Callable[..., Any],
    additive_bool: bool,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-interface signature (``query`` ``[B, Hq, S, D]``, ``key`` / ``value`` ``[B, Hkv, S_kv, D]``,
    ``attention_mask`` the model's own ``[B or 1, 1, S, S_kv]`` mask) computed as the ring computes each chunk:
    ``flex`` with ``return_lse``, head dims zero-padded to a power of two, GQA by ``enable_gqa``. The mask acts as
    the one-device attention function applies it: a float mask is added to the scores (``score_mod``); a boolean
    one is added too where ``additive_bool`` (HF eager: ``scores + mask``), else it selects keys (SDPA); no mask is
    causal within ``module.sliding_window`` (SDPA's ``is_causal``). Returns ``([B, S, Hq, D], None)`` as eager."""
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout or softcap is not None:
        raise NotImplementedError("gemma4_moe.cp_kernels: attention dropout and softcap are not part of the ring")
    rows, _, length, dim = query.shape
    kv_length = key.shape[2]
    block_mask, score_mod = None, None
    if attention_mask is None:
        window = getattr(module, "sliding_window", None) or kv_length + length

        def causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

        block_mask = create_block_mask(causal, None, None, length, kv_length, device=query.device)
    else:
        mask = attention_mask[:, 0, :, :kv_length].expand(rows, length, kv_length)
        if mask.dtype == torch.bool and not additive_bool:

            def selected(b, h, q_idx, kv_idx):
                return mask[b, q_idx, kv_idx]

            block_mask = create_block_mask(selected, rows, None, length, kv_length, device=query.device)
        else:
            added = mask.to(query.dtype)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + added[b, q_idx, kv_idx]

    pad = (1 << (dim - 1).bit_length()) - dim
    scale = float(module.head_dim) ** -0.5 if scaling is None else scaling  # type: ignore[arg-type]
    if pad:
        query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
    out, _lse = flex(
        query.contiguous(), key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
        enable_gqa=query.shape[1] != key.shape[1], return_lse=True,
    )  # fmt: skip
    return out[..., :dim].transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def cp_kernels(model: torch.nn.Module) -> Iterator[str]:
    """Inside: the one-device forward of ``model`` computes every text attention with the kernel its CP ring uses
    (``CP_KERNELS``), under the mask the one-device model builds (so one-device masking, findings G1 / G2, stays
    what it is). What changes, for the duration: HF's attention dispatch (``ALL_ATTENTION_FUNCTIONS.get_interface``)
    returns, for this model's attention modules only, FlexAttention uncompiled as the CP twin gets it on a CPU
    (``model_owned_cp.flex_attention_eager``; on a GPU the twin compiles it, which this run does not; on a CPU its
    backward needs the ``flex_backward_cpu`` stand-in, which the check enters around kernel runs) instead of eager
    or SDPA. Queries, keys, values, norms, MoE, the LM head and the batch are untouched. On exit the dispatch is
    transformers' own again (the instance attribute removed)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention

    targets = {id(m) for m in model.modules() if isinstance(m, Gemma4TextAttention)}
    original = ALL_ATTENTION_FUNCTIONS.get_interface
    kernel = model_owned_cp.flex_attention_eager()

    def get_interface(attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        chosen = original(attn_implementation, default)
        flex = functools.partial(_flex_attention_under_mask, kernel, attn_implementation == "eager")

        def dispatch(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return (flex if id(module) in targets else chosen)(module, *args, **kwargs)

        return dispatch

    ALL_ATTENTION_FUNCTIONS.get_interface = get_interface  # type: ignore[method-assign]
    try:
        yield CP_KERNELS
    finally:
        del ALL_ATTENTION_FUNCTIONS.get_interface


def one_device_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A packed batch as the VLM loader collates it at ``cp_size <= 1``: the indexed mask expanded to the
    ``[B, 1, S, S]`` block-causal mask, ``_packed_seq_ids`` kept only when some row holds two or more
    documents (``neat_packed_vlm_collater``, ``materialize_4d_mask=True``). Unpacked batches are unchanged."""
    ids = batch.get("_packed_seq_ids")
    if ids is None:
        return batch
    out = dict(batch)
    out["attention_mask"] = _indexed_mask_to_4d_block_causal(batch["attention_mask"])
    if not bool(batch["attention_mask"].max() > 1):
        out.pop("_packed_seq_ids")
    return out


def shard(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """``ContextParallelSharder(model, mesh, batch)`` then ``shard``, on the CP twin when ``mesh`` has > 1 rank.

    Returns ``(ctx_factory, local_batch, sharder)``; under CP ``local_batch`` holds ``[B, S_local]`` auxiliary
    streams, the full ``[B, S]`` ``input_ids`` and, under ``"_spec_cp_model"``, the twin ``forward`` runs.
    """
    return model_owned_cp.shard_on_twin(
        model, mesh, batch, padding_token_id, enter=_enter_cp, one_device=one_device_batch
    )


forward = model_owned_cp.twin_forward  # logits [B, S_local, V] in the model dtype, soft-capped


def cp_padded_length(model: torch.nn.Module, seq_len: int, cp_size: int) -> int:
    """Global length a row of ``seq_len`` is padded to at ``cp_size`` (a multiple of ``2 x cp_size``)."""
    return _base.padded_length(seq_len, cp_size, 2 * cp_size)


def _vlm_packed(tokens: torch.Tensor, documents: list[list[int]], pad_id: int) -> dict[str, Any]:
    """as the VLM neat-packing collater emits it for CP (see the module docstring for its keys)."""
    rows = [_base.document_layout(tokens[row], lengths, pad_id) for row, lengths in enumerate(documents)]
    input_ids, labels, doc_ids, position_ids = (torch.stack(column) for column in zip(*rows))
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": doc_ids,
        "position_ids": position_ids,
        "mm_token_type_ids": torch.zeros_like(input_ids),
        "_packed_seq_ids": doc_ids.clone(),
    }


make_batch = _base.packed_kind(_vlm_packed)
