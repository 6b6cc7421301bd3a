"""Qwen3.5-MoE (nemo-automodel 0.7.0): the MTP sublayer's router sees other inputs under CP than on one device, so
its load-balancing loss, and the gradients it reaches, change with CP (finding T4, docs/training_step.md). One
process, no CP, no harness: both inputs are built with the framework's own functions on the same global batch.

- **One device** (``Qwen3_5MoeForConditionalGeneration.forward`` at CP 1): each depth's MTP input is the
  embeddings rolled left (``_rolled_embed_inputs``), so the last position of a document gets the *next* document's
  first token, and the positions are the main positions (``_split_qwen3_5_moe_position_ids``).
- **CP** (the same forward at CP > 1, fed by the recipe's ``model.prepare_mtp_inputs_for_cp`` on the global rows):
  the rolled embeddings are masked with the per-depth validity masks (``_mask_mtp_embed_inputs``: zero where the
  future token leaves the document) and the positions are ``prepare_mtp_inputs_for_cp``'s (0 there).

Only the masked positions differ, and their MTP targets are ``-100`` in both (the script passes the prepared
per-depth targets to ``calculate_mtp_loss`` in both runs), and NEAT's block-causal mask keeps every other position
from attending to them; so only the MTP MoE router's load-balancing statistics read them. The script runs the MTP
loss's backward with each input and compares every MTP parameter's gradient: with the framework's default
``router_aux_loss_coef`` the router's gradient differs (exit 1); with the coefficient 0 (printed as a control)
every gradient is equal.

``--fixed``: the MTP sublayer's MoE treats the masked positions as padding (``padding_mask`` or the inverted
validity mask, on both runs), so its statistics no longer read positions that have no same-document future token:
every gradient is equal (exit 0). Exit 2 when it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/qwen3_5_moe_mtp_aux_inputs.py [--fixed]
"""

import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from examples.automodel.models import qwen3_5_moe as spec  # noqa: E402  (spec.build: the tiny config)


def _mtp_gradients(coef: float, cp_inputs: bool, fixed: bool) -> dict[str, torch.Tensor]:
    """Every MTP parameter's gradient of the recipe's MTP loss on one global NEAT batch; ``cp_inputs``: the MTP
    sublayer gets the CP path's masked inputs instead of one device's rolled ones."""
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
    from nemo_automodel.components.loss.mtp import calculate_mtp_loss
    from nemo_automodel.components.models.qwen3_5_moe.model import (
        _mask_mtp_embed_inputs,
        _rolled_embed_inputs,
        _split_qwen3_5_moe_position_ids,
    )

    model: Any = spec.build(torch.float32, 0, **spec.MTP_OVERRIDES, router_aux_loss_coef=coef)
    batch = spec.make_batch("packed", 19, batch_size=2, documents=[[7, 5, 6], [3, 1, 9]], seed=1)
    rows, length = batch["input_ids"].shape
    batch.setdefault("position_ids", torch.arange(length).repeat(rows, 1))
    prepared = model.prepare_mtp_inputs_for_cp(dict(batch), ignore_index=-100)  # the recipe's call, global rows
    # finding T1's workaround: the padding mask the decoder derives from the 4-D mask's diagonal
    padding = batch["attention_mask"][:, 0].diagonal(dim1=-2, dim2=-1).bool().logical_not()
    mtp, original = model.mtp, type(model.mtp).forward

    def forward(self, hidden_states, *, padding_mask=None, **kwargs):
        if cp_inputs:  # what the CP forward passes instead of input_ids / embed_fn / position_ids
            for key in ("input_ids", "embed_fn", "position_ids"):
                kwargs.pop(key, None)
            kwargs["embed_inputs"] = _mask_mtp_embed_inputs(
                _rolled_embed_inputs(model.model.language_model.embed_tokens(batch["input_ids"]), self.num_depths),
                prepared.valid_masks,
            )
            kwargs["position_ids_per_depth"] = tuple(
                _split_qwen3_5_moe_position_ids(p, batch_size=rows, seq_len=length, device=p.device)
                for p in prepared.position_ids
            )
        if fixed:
            padding_mask = padding_mask | ~prepared.valid_masks[0]
        return original(self, hidden_states, padding_mask=padding_mask, **kwargs)

    mtp.forward = forward.__get__(mtp)
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**kwargs, padding_mask=padding)
    count = int((batch["labels"] != -100).sum())
    loss = calculate_mtp_loss(
        MaskedCrossEntropy(ignore_index=-100, reduction="sum"),
        mtp_per_depth_h=out.mtp_per_depth_h,
        mtp_per_depth_targets=prepared.targets,
        labels=batch["labels"],
        model=model,
        scaling_factor=out.mtp_loss_scaling_factor,
        num_label_tokens=count,
        ignore_index=-100,
    )
    loss.backward()
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for name, p in model.named_parameters()
        if name.startswith("mtp.")
    }


def _differing(coef: float, fixed: bool) -> list[str]:
    one_device = _mtp_gradients(coef, cp_inputs=False, fixed=fixed)
    cp = _mtp_gradients(coef, cp_inputs=True, fixed=fixed)
    out = []
    for name, grad in one_device.items():
        diff = (grad - cp[name]).abs().max().item()
        if diff > 1e-6 * max(grad.abs().max().item(), 1e-30):
            out.append(f"{name} (max |difference| {diff:.3g}, largest one-device value {grad.abs().max().item():.3g})")
    return out


def main(fixed: bool) -> int:
    control = _differing(0.0, fixed)
    print(f"router_aux_loss_coef 0 (control): {len(control)} MTP gradients differ {control}")
    built: Any = spec.build(torch.float32, 0, **spec.MTP_OVERRIDES)  # the framework ships no types
    default = float(built.config.text_config.router_aux_loss_coef)
    differing = _differing(default, fixed)
    print(f"router_aux_loss_coef {default} (the config's default): {len(differing)} MTP gradients differ:")
    for line in differing:
        print(f"  {line}")
    if control:
        print("could not run: the control differs, so the inputs differ elsewhere than the masked positions")
        return 2
    return 1 if differing else 0


if __name__ == "__main__":
    try:
        sys.exit(main("--fixed" in sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
