"""Error budgets for arithmetic comparisons, one table for every consumer.

Each arithmetic check owns its budgets per dtype (``Check.budgets``); properties, golden files and the
verify command ask the judging policy (``cp_harness.judging.policy``), which reads them from the check.
Data movement has no budget: it is compared bit for bit.

A budget is ``(ulp, floor_fraction)``: the largest allowed error in units in
the last place of the compared dtype, and the floor of the per-element scale
as a fraction of the tensor's largest magnitude (see ``cp_harness.judging.compare``).

- float64 tier: element-wise (floor 1/1024) for the models, normwise for the
  loss (see below why). The CP path sums in another
  order than the oracle (attention over gathered keys, cross-rank gradient
  reductions), so deep gradients show a few thousand ULP. Ceiling:
  relative 1e-10 (about 450,000 ULP); the budgets are far inside it.
- float32 tier: the ranks compute in float32, the oracle in float64 on the same
  float32-rounded inputs. Gradients that are small sums of large, nearly
  cancelling terms (softmax saturation, two-token documents) carry errors that
  are large relative to themselves in any float32 implementation, a single
  device included, so this tier is measured normwise (floor = the tensor's
  largest magnitude).

- bfloat16/float16 tier: the contract is that every reduction accumulates in
  float32. The loss values are float32 numbers (the float32 budget, in float32
  ULPs); the gradient of the logits is computed in float32 and rounded once, so
  it is within half a ULP of its dtype: bfloat16 element-wise, float16
  normwise (a mean over many tokens puts gradient elements in float16's
  subnormal range, where relative errors mean nothing). The bfloat16 models
  have a ceiling only (normwise): their error is the model's own bfloat16
  rounding; what CP adds is judged by ``cp_harness.judging.excess``.

Every arithmetic tensor of a multi-rank case must also pass the excess judge
(``cp_harness.judging.excess``): CP error <= c x the error of the same
implementation on one rank + k ULPs, normwise. The budgets here are ceilings
beside it, for what is wrong at every CP size.

Measured (``python -m cp_harness.calibrate``, world sizes 1, 2, 3, 4, 8,
seeds 0 and 1, 300 examples per row and dtype over the two seeds, on
``cp_impl`` and on ``tests/fixtures/alt_reduction_order``; 2026-12-01), worst
error in the budget's measure, both implementations:

=============================  =========  ====================  ======  ========
row (cases over both runs)     measure    worst seen            budget  earlier
=============================  =========  ====================  ======  ========
shifted_cp_loss float64 (438)  normwise*  2.5 ULP (alt)         16      16 elem.
shifted_cp_loss float32 (464)  normwise*  3.1 ULP (alt)         256     256
shifted_cp_loss bf16 gradient  element    0.50 ULP              2       -
shifted_cp_loss fp16 gradient  normwise*  0.64 ULP              2       -
bf16/fp16 loss values          normwise*  1.6 / 1.1 f32 ULP     256     -
model float64 (988)            element    2,208 ULP (alt)       16,384  16,384
model float32 (988)            normwise   5.9 ULP               128     128
model bfloat16 (988)           normwise   3.9 ULP               16      -
=============================  =========  ====================  ======  ========

(*) at the scale a cross-entropy rounds at: loss values at the mean of
``max(|logsumexp|, max |logit|)`` over the counted rows, the logits'
gradient at ``1 / count`` (``checks.loss.cross_entropy_scale``).

The float64 loss was judged element-wise (floor 1/1024) and relative to its own
value until the second implementation came; it computes the same cross-entropy
as ``logsumexp - picked``: its gradient elements that cancel (``p - 1`` with
``p`` near 1) carried up to 1,010 ULPs of themselves, and a single confident
target (a 0.002 loss) 396 ULPs, while the rounding was 2e-16 absolute. Both
measures had followed the rounding of PyTorch's fused log-softmax, which the
oracle and ``cp_impl`` share: false alarms on a correct implementation. The
budget is unchanged; the scale is the one any cross-entropy rounds at. No
broken fixture gets through: a lost target or a scaling error is 1e13 ULPs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Budget:
    ulp: float
    floor_fraction: float


# The numbers live with their checks (``Check.budgets``: ``checks/loss.py``, ``checks/models.py``); the
# policy that applies them is ``cp_harness.judging.policy``.
