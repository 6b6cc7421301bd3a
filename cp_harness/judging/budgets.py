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

The measurements behind every number, and how the float64 loss came to be judged
at a cross-entropy's rounding scale: ``docs/budgets.md`` and ``docs/history.md``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Budget:
    ulp: float
    floor_fraction: float


# The numbers live with their checks (``Check.budgets``: ``checks/loss.py``, ``checks/models.py``); the
# policy that applies them is ``cp_harness.judging.policy``.
