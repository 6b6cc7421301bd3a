"""The framework's TE THD batch sharding (``make_cp_batch_for_te``, adapter ``te_thd_batch``) on CPU ranks with the
stand-in ``te_thd_partition_cpu`` for TE's partition kernel, judged by the verb row on THD packs as the framework's
packer pads them: passes at CP 1-3 saying the stand-in ran; two one-line regressions of the framework's strategy
fail naming what they corrupt (the layout's rows transposed; ``input_ids`` left out of the partitioned keys).
Runs on the shared real-model pool (3 ranks, the fixtures importable)."""

from __future__ import annotations

import pytest

from cp_harness.judging.render import report_text

REAL_MODELS = True  # the shared pool of tests/conftest.py (``real_models``): the framework imports, fixtures too
JUDGES = ("adapter:te_thd_batch",)
ADAPTER = "examples.automodel.adapters.te_thd_batch"


def _case(n: int, docs: list[list[int]], seed: int, forms: list[dict], impl: str = ADAPTER) -> dict:
    seq_len = sum(padded for _, padded in docs)
    return {
        "check": "sharder_verbs",
        "impl": impl,
        "world_size": n,
        "seed": seed,
        "model": "mistral_large4",
        "layout": "packed",
        "rows": 1,
        "seq_len": seq_len,
        "batch": {"format": "thd", "seq_len": seq_len, "docs": [docs], "given_positions": True},
        "tokens_held": True,
        "dtype": "float32",
        "forms": forms,
    }


CALLER = {"lead": [], "trail": [2], "coords": "caller", "fill": -1, "trim": True}
PADDED = {"lead": [3], "trail": [], "coords": "padded", "fill": 0, "trim": False}
# documents [real, padded]: padded to 2N; a one-token document; the pack's padding in the last span
CASES = [
    _case(1, [[3, 3], [1, 1]], 1, [CALLER]),
    _case(2, [[3, 4], [1, 4], [5, 12]], 2, [CALLER, PADDED]),
    _case(3, [[7, 12], [6, 6], [1, 12]], 3, [CALLER, PADDED]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c['world_size']}")
def test_te_thd_batch_sharding_passes_on_the_stand_in(real_models, case):
    report = real_models.run(case)
    assert report.ok, report_text(report)
    names = {c.name for c in report.comparisons}
    assert any(n.startswith("the sharded batch's input_ids") for n in names), names
    if case["world_size"] > 1:  # at CP 1 the framework returns before asking TE for a partition
        assert set(report.standins) == {"te_thd_partition_cpu"}, report.standins
        assert "CPU, stand-in: TE THD partition index kernel" in report.standins["te_thd_partition_cpu"]


@pytest.mark.parametrize(
    "fixture, words",
    [
        ("te_thd_batch_rows_transposed", "shard_layout.input_row_shape=(20, 1)"),
        ("te_thd_batch_ids_not_selected", "the sharded batch's input_ids = shard_token_tensor(input_ids)@rank0"),
    ],
)
def test_a_regression_in_the_framework_strategy_fails_naming_what_it_corrupts(real_models, fixture, words):
    report = real_models.run({**CASES[1], "impl": fixture})
    text = report_text(report)
    assert not report.ok and words in text, text
