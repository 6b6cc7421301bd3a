"""The framework's EAGLE-3 CP attention (ring, zig-zag ring, Ulysses) under the ``cp_attention`` check, on the shared
real-model pool (3 ranks), on the ``flash_attn_cpu`` stand-in: a small smoke per subject (CP 2 float16, CP 3
bfloat16 with three TTT blocks, Ulysses packed), a one-line regression per subject that must fail naming what it
corrupts, and a bad case refused on every rank. Deeper runs: ``./scripts/real_clients attention:<subject>``."""

from __future__ import annotations

import pytest

from cp_harness.checks import cp_attention

REAL_MODELS = True
JUDGES = ("attention:eagle_ring", "attention:eagle_zigzag", "attention:eagle_ulysses")

SUBJECTS = ("eagle_ring", "eagle_zigzag", "eagle_ulysses")
PACKAGE = "examples.automodel.attention"
EVERY = {"attention output", "dq", "dk block 0 (ring / all-to-all)", "dv block 0 (ring / all-to-all)"}
SHIFT = "trainer's TTT left shift on this layout"  # the framework trainer's shift must agree with the index map


@pytest.mark.parametrize("subject", SUBJECTS)
def test_the_framework_attention_matches_float64_attention(real_models, subject):
    for case in cp_attention.smoke_cases(f"{PACKAGE}.{subject}"):
        report = real_models.run(case)
        assert report.ok, report.summary() if hasattr(report, "summary") else report
        assert set(report.standins) == {"flash_attn_cpu"}
        names = {c.name for c in report.comparisons}
        blocks = int(case["blocks"])
        assert names == {"attention output", "dq", SHIFT} | {
            f"{g} block {i} ({'ring / all-to-all' if i == 0 else 'TTT diagonal'})"
            for g in ("dk", "dv")
            for i in range(blocks)
        }
        # judged against the one-rank run too (the excess judge), not only the ULP budget
        assert all(c.excess is not None for c in report.comparisons if c.name != SHIFT), report.comparisons


@pytest.mark.parametrize(
    "fixture,subject,world,corrupted",
    [
        # CP 2: rank 1 merges one received block: the output is right, the LSE the backward is handed is not
        ("attention_subject_eagle_ring_lse_not_updated", "eagle_ring", 2, EVERY - {"attention output"}),
        ("attention_subject_eagle_ring_lse_not_updated", "eagle_ring", 3, EVERY),
        ("attention_subject_eagle_zigzag_chunks_swapped", "eagle_zigzag", 3, EVERY | {SHIFT}),
        ("attention_subject_eagle_ulysses_heads_interleaved", "eagle_ulysses", 2, EVERY),
    ],
)
def test_a_regression_fails_naming_what_it_corrupts(real_models, fixture, subject, world, corrupted):
    case = next(c for c in cp_attention.smoke_cases(f"{PACKAGE}.{subject}") if c["world_size"] == world)
    report = real_models.run(dict(case, subject=fixture))
    failed = {c.name for c in report.failures()}
    assert not report.ok and not report.problems, report.problems
    assert corrupted <= failed, failed
    if "attention output" not in corrupted:
        assert "attention output" not in failed  # a gradient-only defect is reported as one
    if SHIFT not in corrupted:
        assert SHIFT not in failed  # the layout is still the trainer's
    worst = max((c for c in report.failures() if c.name != SHIFT), key=lambda c: c.max_ulp)
    assert worst.mismatched > 0 and worst.location is not None and "owning_rank" in worst.location


def test_a_case_the_framework_refuses_is_refused_on_every_rank_naming_the_key(real_models):
    """Every rank validates the case before its first collective (the same function of the case alone), so no rank
    waits for a peer that gave up: each rank's refusal is a problem of the report."""
    good = cp_attention.smoke_cases(f"{PACKAGE}.eagle_zigzag")[0]
    report = real_models.run(dict(good, seq_len=6))  # CP 2 zig-zag needs 2N = 4 to divide S
    assert not report.ok and sorted(p.rank for p in report.problems) == [0, 1]
    assert all("ValueError" in p.message and "seq_len=6" in p.message and "multiple of 4" in p.message
               for p in report.problems), report.problems  # fmt: skip
    assert real_models.run(good).ok


@pytest.mark.parametrize(
    "subject,change,words",
    [
        ("eagle_ulysses", dict(heads=3), "heads=3"),
        ("eagle_ring", dict(documents=[4, 4]), "documents: eagle_ring takes no packed"),
        ("eagle_ulysses", dict(documents=[4, 3]), "summing to seq_len=8"),
        ("eagle_zigzag", dict(batch=2), "batch=2"),
        ("eagle_ring", dict(dtype="float32"), "dtype='float32'"),
        ("eagle_ring", dict(blocks=0), "blocks"),
    ],
)
def test_validate_names_the_key_and_the_fix(subject, change, words):
    module = cp_attention.load_subject(f"{PACKAGE}.{subject}")
    case = dict(cp_attention.smoke_cases(f"{PACKAGE}.{subject}")[0], **change)
    with pytest.raises(ValueError, match=__import__("re").escape(words)):
        cp_attention.validate(case, module)
