"""DeepSeek V4.1 (nemo-automodel 0.7.0): the recipe's linear-projection loss cannot train it. ``train_ft.py``'s
``_forward_backward_step`` runs a ``LinearCrossEntropy`` loss (``ChunkedCrossEntropy``, ``FusedLinearCrossEntropy``)
with ``model(**batch, logits_to_keep=1, output_hidden_states=True)`` and takes ``get_final_hidden_states(out)`` as
the loss's input. ``DeepseekV41ForCausalLM.forward`` reads ``output_hidden_states`` as "capture residual streams
for numerical comparisons": ``out.hidden_states`` is the tuple of hyper-connection streams before each block,
``[B, S, hc_mult, H]``, not the final normed hidden states ``[B, S, H]`` the LM head projects (those come with
``return_hidden_states=True``, which the recipe never passes). ``calculate_loss`` then raises
``ValueError: hidden_states token dimensions must match labels.shape``. One process, no CP, no harness.

Exit status 1 while the recipe's call raises (the defect), 0 with ``--fixed`` (the same call with
``return_hidden_states=True``: the loss equals ``MaskedCrossEntropy`` on the full logits); 2 when it could not run.

    PYTHONPATH=. python examples/automodel/repro/models/deepseek_v41_linear_ce_hidden_states.py [--fixed]
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from nemo_automodel.components.loss.chunked_ce import ChunkedCrossEntropy  # noqa: E402
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy  # noqa: E402
from nemo_automodel.components.loss.utils import calculate_loss, prepare_lm_weight  # noqa: E402
from nemo_automodel.components.training.model_output_utils import get_final_hidden_states  # noqa: E402

from examples.automodel.models import deepseek_v41 as spec  # noqa: E402  (spec.build: the tiny config)


def main(fixed: bool) -> int:
    model = spec.build(torch.float32, 0)
    ids = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    flag = {"return_hidden_states": True} if fixed else {"output_hidden_states": True}  # the recipe: the latter
    out = model(input_ids=ids, logits_to_keep=1, **flag)
    hidden = get_final_hidden_states(out)
    print(f"model(..., logits_to_keep=1, {next(iter(flag))}=True): final hidden states {list(hidden.shape)}")
    loss_fn = ChunkedCrossEntropy(compile=False)
    try:
        loss = calculate_loss(
            loss_fn,
            logits=out.logits,
            labels=labels,
            model=model,
            hidden_states=hidden,
            num_label_tokens=7,
            lm_weight=prepare_lm_weight(loss_fn, model),
            logits_dtype=out.logits.dtype,
        )
    except ValueError as exc:
        print(f"calculate_loss(ChunkedCrossEntropy, ...) raised ValueError: {exc}")
        return 1
    full = MaskedCrossEntropy()(model(input_ids=ids).logits, labels, num_label_tokens=7)
    ok = torch.allclose(loss, full, rtol=1e-5, atol=1e-6)
    print(
        f"linear-CE loss {loss.item():.6f}, MaskedCrossEntropy on the full logits {full.item():.6f}: "
        f"{'ok' if ok else 'WRONG'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main("--fixed" in sys.argv[1:]))
    except Exception as exc:  # noqa: BLE001
        print(f"could not run: {type(exc).__name__}: {exc}")
        sys.exit(2)
