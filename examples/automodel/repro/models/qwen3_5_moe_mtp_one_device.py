"""Qwen3.5-MoE (nemo-automodel 0.7.0): MTP training on one device (no CP) raises on a NEAT-packed batch (finding
T1, docs/training_step.md). ``Qwen3_5MoeForConditionalGeneration.forward`` hands its MTP head the batch's 4-D
block-causal ``attention_mask`` ``[B, 1, S, S]`` with ``padding_mask=None`` (the decoder derives its padding mask
from the mask's diagonal for itself, ``Qwen3_5MoeTextModelBackend.forward``, but keeps it local);
``qwen3_next.Block.forward`` then inverts the whole 4-D mask as a padding mask (``attention_mask.bool()
.logical_not()``), and the MTP sublayer's MoE raises ``RuntimeError: The size of tensor a (S*B) must match the size
of tensor b (B*S*S)`` in ``Gate._compute_aux_loss``. The batch is the framework's own NEAT pack
(``neat_packed_collater``, through the spec's ``make_batch``); the model is the spec's tiny config with the HF
config field ``mtp_num_hidden_layers=1``. One process, no CP, no harness.

Exit status 1 while the forward raises (the defect), 0 with ``--fixed`` (the same forward with ``padding_mask`` =
the mask's diagonal inverted, what the decoder derives: the main logits are unchanged and the MTP head runs); 2
when it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/qwen3_5_moe_mtp_one_device.py [--fixed]
"""

import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from examples.automodel.models import qwen3_5_moe as spec  # noqa: E402  (spec.build: the tiny config)


def main(fixed: bool) -> int:
    model: Any = spec.build(torch.float32, 0, **spec.MTP_OVERRIDES)  # the framework ships no types
    batch = spec.make_batch("packed", 19, batch_size=2, documents=[[7, 5, 6], [3, 1, 9]], seed=1)
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    print(f"NEAT batch: attention_mask {list(batch['attention_mask'].shape)}, MTP depths {model.mtp_config.num_layers}")
    plain = None
    if fixed:
        with torch.no_grad():
            model.mtp, saved = None, model.mtp  # the main model alone, for the logits check
            plain = model(**kwargs).logits
            model.mtp = saved
        kwargs["padding_mask"] = batch["attention_mask"][:, 0].diagonal(dim1=-2, dim2=-1).bool().logical_not()
    try:
        out = model(**kwargs)
    except RuntimeError as exc:
        print(f"model(**neat_batch) in train mode raised RuntimeError: {exc}")
        return 1
    same = plain is None or torch.equal(out.logits, plain)
    print(f"MTP hidden states {[list(h.shape) for h in out.mtp_per_depth_h]}; main logits unchanged: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    try:
        sys.exit(main("--fixed" in sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
