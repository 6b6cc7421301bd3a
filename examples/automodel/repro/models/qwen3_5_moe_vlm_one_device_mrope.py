"""Qwen3.5-MoE VLM (nemo-automodel 0.7.0): on one device the image tokens get no mRoPE positions; under CP they do
(finding M8, docs/models/qwen3_5_moe_vlm.md). One process, no ranks, no harness: the framework's own model, hook
and forward on one batch as the VLM recipe's default collater lays it out (``input_ids``, ``attention_mask``,
``labels``, ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``; no ``position_ids``: ``default_collate_fn``
leaves them to "get_rope_index inside the model forward").

- **CP** (> 1): the recipe's ``ContextParallelSharder`` calls ``prepare_model_inputs_for_cp``, which computes the
  positions on the full row with ``get_rope_index`` (image tokens at their (t, h, w) grid coordinates, text after an
  image continuing from the grid's extent), then shards them.
- **One device** (CP 1): no hook runs, and ``Qwen3_5MoeModel.forward`` hands HF's VL forward ``input_ids=None``
  (it embeds them itself first), so HF's ``compute_3d_position_ids`` cannot call ``get_rope_index`` and returns
  ``None``: the text decoder falls back to ``0 .. S-1`` on all three axes.

The script captures the positions the text decoder receives on one device and compares them with the hook's, then
compares the logits of one device as given with one device given the hook's positions. Exit 1 while they differ.

``--fixed``: the one-device forward gets the positions the hook computes (what a fix in the forward, computing them
from ``input_ids`` when none are given, would do): the decoder then sees the CP positions (exit 0). Exit 2 when it
could not run.

    PYTHONPATH=. python examples/automodel/repro/models/qwen3_5_moe_vlm_one_device_mrope.py [--fixed]
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typing import Any  # noqa: E402

import torch  # noqa: E402

from examples.automodel.models import qwen3_5_moe_vlm as _spec  # noqa: E402  (spec.build: the tiny config)

spec: Any = _spec  # the spec module's functions, untyped (its make_batch overrides _base's)


def _decoder_positions(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [3, B, S] the text decoder used, logits [B, S, V])`` of one one-device forward."""
    seen = {}
    decoder = model.model.language_model

    def hook(module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # the decoder's own fallback (Qwen3_5MoeTextModelBackend.forward): 0..S-1 x 3
            length = kwargs["inputs_embeds"].shape[1]
            position_ids = torch.arange(length).view(1, 1, -1).expand(3, kwargs["inputs_embeds"].shape[0], -1)
        seen["positions"] = position_ids.clone()

    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    finally:
        handle.remove()
    return seen["positions"], logits


def main(fixed: bool) -> int:
    model: Any = spec.build(torch.float32, 0)  # the framework ships no types
    # One row of 13 tokens with a 2 x 3 image at positions 2..7, as default_collate_fn leaves it (+ the processor's
    # mm_token_type_ids: 1 on image tokens).
    batch = spec.make_batch("images", 13, batch_size=1, seed=3, images=[[[2, 2, 3]]])
    batch["mm_token_type_ids"] = (batch["input_ids"] == spec.IMAGE_TOKEN_ID).long()
    cp_positions = model.prepare_model_inputs_for_cp(dict(batch))["position_ids"]  # the CP hook, full row
    # The hook also leaves model.model.rope_deltas set, which HF's forward would then add to 0..S-1 (a shift, same
    # logits under RoPE); a CP-1 run never calls the hook, so reset it to what such a run has.
    model.model.rope_deltas = None
    given = dict(batch, position_ids=cp_positions) if fixed else batch
    positions, logits = _decoder_positions(model, given)
    _, logits_with_cp_positions = _decoder_positions(model, dict(batch, position_ids=cp_positions))
    print(
        f"input_ids: {batch['input_ids'][0].tolist()} (image token {spec.IMAGE_TOKEN_ID}, grid {batch['image_grid_thw'].tolist()})"
    )
    print(f"CP hook's positions (t/h/w):      {cp_positions[:, 0].tolist()}")
    print(f"one device's decoder positions:   {positions[:, 0].tolist()}")
    differ = sorted({int(i) for i in (positions != cp_positions).any(0)[0].nonzero().flatten()})
    moved = (logits - logits_with_cp_positions).abs().amax(-1)[0]
    print(f"positions that differ: {differ}")
    print(
        f"max |logits one device - one device with the CP positions| per position: {[f'{x:.2g}' for x in moved.tolist()]}"
    )
    if differ:
        print("DEFECT: one device trains image tokens (and the text after them) at 1-D positions; CP at mRoPE's")
        return 1
    print("one device's decoder sees the positions the CP hook computes")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main("--fixed" in sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
