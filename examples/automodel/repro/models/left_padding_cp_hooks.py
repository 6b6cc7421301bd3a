"""nemo-automodel 0.7.0's default CP path drops the attention mask, so left-padded rows attend their padding under
CP (finding S5, docs/real_clients.md). One process, no CP, no harness.

At ``cp_size > 1`` the dense-model setup calls ``attach_context_parallel_hooks(model)``: a pre-hook on every
``self_attn`` that replaces ``attention_mask`` by ``None`` and sets ``is_causal=True`` (torch's ring SDPA takes no
mask), and ``shard_batch_load_balanced`` pops the batch's ``attention_mask``. With right padding that is harmless
(causal attention never reads the padding behind a token). With left padding, what the framework's chat-template
formatting emits with a left-padding tokenizer (``format_chat_template`` with ``padding="max_length"``, whose loss
mask it shifts for exactly that case, ``_maybe_shift_mask_for_left_padding``), every real token then attends the
pad tokens before it: the model computes another function than at ``cp_size`` 1, where the identity sharder keeps
the mask. This script runs the framework's Llama (the ``load_balanced_sdpa`` spec's tiny config) on left-padded
rows with the mask (what one device computes) and again with the framework's CP hooks attached (what every CP rank's
attention receives; the ring itself only distributes the same causal attention), and compares the logits at the
real positions.

Exit status 1 while they differ (the defect); 0 with ``--fixed`` (the same rows padded on the right, as a
right-padding tokenizer gives them: the hooked model then equals the masked one at every real position); 2 when it
could not run.

    PYTHONPATH=. python examples/automodel/repro/models/left_padding_cp_hooks.py [--fixed]
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from examples.automodel.models import load_balanced_sdpa as spec  # noqa: E402  (spec.build: the tiny config)

ROWS, LENGTH, PAD = 2, 10, 3


def main(fixed: bool) -> int:
    from nemo_automodel.components.distributed.context_parallel.utils import attach_context_parallel_hooks

    model = spec.build(torch.float32, 0)
    real = torch.randint(1, 64, (ROWS, LENGTH - PAD), generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(ROWS, PAD, dtype=real.dtype)
    ids = torch.cat([real, pad] if fixed else [pad, real], dim=1)
    mask = torch.cat([torch.ones_like(real), pad] if fixed else [pad, torch.ones_like(real)], dim=1)
    where = slice(0, LENGTH - PAD) if fixed else slice(PAD, LENGTH)
    with torch.no_grad():
        one_device = model(input_ids=ids, attention_mask=mask).logits[:, where]
        attach_context_parallel_hooks(model)
        under_cp_hooks = model(input_ids=ids, attention_mask=mask).logits[:, where]
    diff = (one_device - under_cp_hooks).abs().max().item()
    side = "right" if fixed else "left"
    print(
        f"{side}-padded rows [{ROWS}, {LENGTH}] ({PAD} pad tokens each): max |logit difference| at the real positions "
        f"with the framework's CP hooks vs with the attention mask: {diff:.3g} (largest logit "
        f"{one_device.abs().max().item():.3g})"
    )
    return 0 if diff <= 1e-5 * one_device.abs().max().item() else 1


if __name__ == "__main__":
    try:
        sys.exit(main("--fixed" in sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
