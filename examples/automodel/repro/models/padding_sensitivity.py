"""Padding alone changes DeepSeek V4.1's logits on ONE process (nemo-automodel 0.7.0, float32, CPU).

With a small indexer selection (index_topk=3, candidate_topk_blocks=2) the indexer's hard top-k meets exact
ties (relu() zeros, and -inf for masked keys); torch.topk breaks them by the row width, and one masked pad
token changes that width. CP 2 pads a 15-token row to 16 the same way, so CP 2 differs from one rank by
exactly this amount (tools/run_standalone.py --case plain:15:1 --overrides index_topk=3,candidate_topk_blocks=2
--padding-check). Run: PYTHONPATH=. python examples/automodel/repro/models/padding_sensitivity.py
"""

import torch

from examples.automodel.models import deepseek_v41 as spec

model = spec.build(torch.float32, seed=0, index_topk=3, candidate_topk_blocks=2).eval()
batch = spec.make_batch("plain", 15, seed=1)  # 15 real tokens, no padding
padded = spec.pad_batch(batch, 16)  # + one pad token, attention_mask 0, label -100
with torch.no_grad():
    a = spec.forward(model, spec.shard(model, None, batch)[1])
    b = spec.forward(model, spec.shard(model, None, padded)[1])[:, :15]
change = (a - b).abs().amax(-1)[0]
print("max |logit change| per real position:", [f"{v:.1e}" for v in change.tolist()])
print("worst:", f"{change.max():.3g}", "at position", int(change.argmax()))  # 0.456 at 14 (rounding elsewhere: ~1e-6)
