"""The shifted loss across shard boundaries equals the single-device mean loss."""

from hypothesis import example, given, settings

from cp_harness import strategies
from cp_harness.profiles import examples


@settings(max_examples=examples(1.0))
@given(case=strategies.loss_cases())
@example(case={"check": "shifted_cp_loss", "world_size": 2, "seed": 5, "model": "mistral_large4", "dtype": "float64",
               "vocab": 7, "batch": {"format": "bshd", "seq_len": 6, "rows": [[0, 0], [0, 0]]}})  # nothing counts
@example(case={"check": "shifted_cp_loss", "world_size": 4, "seed": 6, "model": "mistral_large4", "dtype": "float64",
               "vocab": 5, "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 4], [4, 4]]]}})  # targets across boundaries
def test_shifted_cp_loss_matches_oracle(cp_runner, case):
    cp_runner.check(case)
