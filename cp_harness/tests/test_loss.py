"""The shifted loss across shard boundaries equals the single-device mean loss, in every logits dtype.

bfloat16/float16 logits: the loss is accumulated and returned in float32 (judged in float32 ULPs), the
gradient rounded once to the logits' dtype; every multi-rank case is also judged against one rank of the
same implementation (``cp_harness.judging.excess``)."""

from hypothesis import example, given, settings

from cp_harness.checks.loss import loss_cases
from cp_harness.cases.profiles import examples


@settings(max_examples=examples(2.0))
@given(case=loss_cases())
@example(case={"check": "shifted_cp_loss", "world_size": 2, "seed": 5, "model": "mistral_large4", "dtype": "float64",
               "vocab": 7, "batch": {"format": "bshd", "seq_len": 6, "rows": [[0, 0], [0, 0]]}})  # nothing counts
@example(case={"check": "shifted_cp_loss", "world_size": 4, "seed": 6, "model": "mistral_large4", "dtype": "float64",
               "vocab": 5, "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 4], [4, 4]]]}})  # targets across boundaries
@example(case={"check": "shifted_cp_loss", "world_size": 3, "seed": 7, "model": "mistral_large4", "dtype": "bfloat16",
               "vocab": 11, "batch": {"format": "bshd", "seq_len": 20, "rows": [[0, 20], [3, 17]]}})
@example(case={"check": "shifted_cp_loss", "world_size": 8, "seed": 8, "model": "mistral_large4", "dtype": "float16",
               "vocab": 13, "batch": {"format": "thd", "seq_len": 17, "docs": [[[9, 9], [7, 8]]]}})
def test_shifted_cp_loss_matches_oracle(cp_runner, case):
    cp_runner.check(case)
