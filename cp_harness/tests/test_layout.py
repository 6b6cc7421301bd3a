"""The hooks shard labels, positions, padding and documents exactly as the oracle lays them out."""

from hypothesis import example, given, settings

from cp_harness.checks.layout import layout_cases
from cp_harness.cases.profiles import examples


@settings(max_examples=examples(3.0))
@given(case=layout_cases())
@example(case={"check": "inkling2_layout", "world_size": 3, "seed": 7, "model": "inkling2", "num_chunks": 1,
               "batch": {"format": "thd", "seq_len": 10, "docs": [[[1, 1], [0, 2], [4, 5]]], "eos_is_pad": True}})
@example(case={"check": "mistral_large4_layout", "world_size": 8, "seed": 8, "model": "mistral_large4",
               "num_chunks": 2, "shard_primary": False,
               "batch": {"format": "thd", "seq_len": 9, "docs": [[[2, 3], [5, 5]], [[9, 9]]]}})
@example(case={"check": "mistral_large4_layout", "world_size": 2, "seed": 9, "model": "mistral_large4",
               "num_chunks": 1, "shard_primary": True,
               "batch": {"format": "bshd", "seq_len": 7, "rows": [[3, 4], [0, 0]]}})
def test_sharded_layout_matches_oracle(cp_runner, case):
    cp_runner.check(case)
