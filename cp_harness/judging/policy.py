"""The judging policy: how strictly arithmetic results are judged, handed to the judge (never set globally).

Each arithmetic check owns its ULP budgets per dtype (``Check.budgets``); the policy decides how they
are applied, and the excess judge's factor ``c`` and floors ``k`` (``cp_harness.judging.excess``):

- ``STRICT``: the contract as documented (``docs/budgets.md``): every sum of bfloat16/float16 values is
  accumulated in float32 and rounded once, so a gather's or halo's gradient is one bit pattern.
- ``PAYLOAD``: partial sums may be kept in the payload's precision, as a backend's bfloat16 reduce-scatter
  does unless float32 accumulation is asked for: a sum of ``k`` contributions may be off by ``k - 1`` ULPs
  of its dtype at the scale of the sum of their magnitudes (a sequential sum in that precision rounds at
  most ``k - 1`` times, each by half a ULP: the budget is twice the bound). Everything else as ``STRICT``.
- ``UNJUDGED``: no budget and no excess limit, every error still measured; what
  ``python -m cp_harness.calibrate`` uses to record the errors the budgets rest on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from cp_harness.judging.budgets import Budget


@dataclasses.dataclass(frozen=True)
class ExcessRule:
    """``limit``: the factor ``c``; ``floor``: ULPs CP may add over an exact baseline."""

    limit: float
    floor: float


# c = 2: CP may at most double the one-rank error; k: the floor at the tensor's scale. Measured with
# ``python -m cp_harness.calibrate`` on cp_impl and tests/fixtures/alt_reduction_order (seeds 0 and 1, 300
# cases per row and dtype, world sizes 1-8): at these floors no tensor needed more than c = 0.37 (margin
# 5.4); float64 needs the larger floor because its one-rank run is often exact (0 ULP) while CP's own
# roundings (N x scaling, the average over ranks, reordered sums) reach 6.7 ULP. Figures: docs/budgets.md.
EXCESS_LIMIT = 2.0
EXCESS_FLOOR = {"float64": 16.0, "float32": 4.0, "bfloat16": 4.0, "float16": 4.0}


@dataclasses.dataclass(frozen=True)
class JudgingPolicy:
    """``judged=False`` measures every error without failing any (calibration)."""

    name: str
    judged: bool = True
    payload_sums: bool = False  # sums of bfloat16/float16 contributions may round in the payload's precision
    excess_limit: float = EXCESS_LIMIT
    excess_floor: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(EXCESS_FLOOR))

    def budget(self, check: Any, dtype: str) -> Budget:
        """The budget of ``check`` (a ``cp_harness.checks.Check``) at ``dtype``."""
        if dtype not in check.budgets:
            raise KeyError(
                f"check {check.name!r} has no error budget for {dtype}; add one to its budgets (cp_harness/checks/)"
            )
        budget = check.budgets[dtype]
        return budget if self.judged else Budget(math.inf, budget.floor_fraction)

    def excess_rule(self, dtype: str) -> ExcessRule:
        """The excess judge's ``c`` and floor for a tensor compared in ULPs of ``dtype``."""
        if dtype not in self.excess_floor:
            raise KeyError(f"no excess floor for {dtype} in policy {self.name!r}")
        return ExcessRule(self.excess_limit, self.excess_floor[dtype]) if self.judged else ExcessRule(math.inf, 0.0)


STRICT = JudgingPolicy("strict")
PAYLOAD = JudgingPolicy("payload", payload_sums=True)
UNJUDGED = JudgingPolicy("unjudged", judged=False)
POLICIES = {policy.name: policy for policy in (STRICT, PAYLOAD)}  # what --precision-policy chooses from


def policy_named(name: str) -> JudgingPolicy:
    if name not in POLICIES:
        raise ValueError(f"precision policy {name!r}: choose {' or '.join(POLICIES)}")
    return POLICIES[name]
