"""Model spec: ``qwen3_5_moe_vlm`` (nemo-automodel 0.7.0's Qwen3.5-MoE VLM with images, CP through
``shard_batch_aux_only``) whose batches carry the mRoPE positions a loader computes with the model's own
``get_rope_index`` (the builder ``resolve_get_rope_index`` finds, called as the VLM recipe's NEAT packer calls it in
``datasets/vlm/neat_packing_vlm._compute_mrope_position_ids``: token types 1 on image tokens, the rows' image grids;
that module itself needs HF ``datasets``, absent here). Everything else is ``qwen3_5_moe_vlm``'s.

Why a second spec: on the default collater's batches (no ``position_ids``) one device trains the image tokens at
1-D positions while CP computes mRoPE's (finding M7, ``docs/models/qwen3_5_moe_vlm.md``), so every such case fails
at CP >= 2 on that finding whatever the CP path does. With the positions in the batch both sides read them, and
the CP path with images (the splice before the round-robin shard, the vision tower's and the embeddings'
gradients, the ring) is judged against one device. What this spec does not exercise: the hook's own
``get_rope_index`` call (it keeps the given positions), which ``qwen3_5_moe_vlm`` runs.

Shapes: as ``qwen3_5_moe_vlm``; ``position_ids [3, B, S]`` int64 (t, h, w axes).
"""

from __future__ import annotations

from typing import Any

import torch
from nemo_automodel._transformers.utils import resolve_get_rope_index

from examples.automodel.models import qwen3_5_moe_vlm as _vlm
from examples.automodel.models.qwen3_5_moe_vlm import *  # noqa: F401,F403  (the same spec interface)
from examples.automodel.models.qwen3_5_moe_vlm import COVERS as _COVERS

NAME = "qwen3_5_moe_vlm_mrope"
# The hook keeps given positions: its get_rope_index call is qwen3_5_moe_vlm's to cover.
COVERS: dict[str, str] = {
    **_COVERS,
    "nemo_automodel.components.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration.prepare_model_inputs_for_cp": "the model's CP hook: keeps the batch's mRoPE positions, selects shard_batch_aux_only",
}
BATCH_KEYS: dict[str, dict[str, str]] = {
    **_vlm.BATCH_KEYS,
    "optional": {
        **_vlm.BATCH_KEYS["optional"],
        "position_ids": "[3, B, S] int64 mRoPE positions (t, h, w) of the full row, from get_rope_index "
        "(added by shard from the model, as the loader adds them)",
    },
}


def with_positions(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` plus ``position_ids [3, B, S]``: the mRoPE positions of every row by the model's ``get_rope_index``
    (``resolve_get_rope_index``), with token types 1 on image tokens and the batch's image grids ``[I, 3]``."""
    get_rope_index = resolve_get_rope_index(model)
    if get_rope_index is None:
        raise ValueError(f"{NAME}: the model has no get_rope_index")
    token_types = (batch["input_ids"] == _vlm.IMAGE_TOKEN_ID).long()
    positions, _ = get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=token_types,
        image_grid_thw=batch.get("image_grid_thw"),  # absent on text-only rows (a dp rank without images)
        attention_mask=batch.get("attention_mask"),
    )
    inner: Any = model.model  # the framework ships no types
    inner.rope_deltas = None  # get_rope_index's caller keeps its deltas on the model; the step sets its own
    return {**batch, "position_ids": positions}


def shard(model: torch.nn.Module, mesh: Any, batch: dict[str, Any], padding_token_id: int = 0):
    """``qwen3_5_moe_vlm.shard`` on the batch with the loader's mRoPE positions (``with_positions``); returns
    ``(ctx_factory, local_batch, sharder)``, ``local_batch`` tensors ``[B, S_local]``, positions ``[3, B, S_local]``."""
    return _vlm.shard(model, mesh, with_positions(model, batch), padding_token_id)
