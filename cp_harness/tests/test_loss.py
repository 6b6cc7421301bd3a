"""The shifted loss across shard boundaries equals the single-device mean loss, in every logits dtype.

bfloat16/float16 logits: the loss is accumulated and returned in float32 (judged in float32 ULPs), the
gradient rounded once to the logits' dtype; every multi-rank case is also judged against one rank of the
same implementation (``cp_harness.judging.excess``)."""

from hypothesis import given, settings

from cp_harness.cases.profiles import examples
from cp_harness.checks.loss import SHIFTED_CP_LOSS, loss_cases


@settings(max_examples=examples(2.0))
@given(case=loss_cases())
@SHIFTED_CP_LOSS.with_examples()
def test_shifted_cp_loss_matches_oracle(cp_runner, case):
    cp_runner.check(case)
