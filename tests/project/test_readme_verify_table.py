"""The README's verify table is in step with the rows the checks declare (no ranks; imports the checks).

The sample under "What `verify` prints" must list, in its first column, exactly the rows ``./scripts/verify``
prints by default (``cp_harness.verify.default_rows()`` without the real-model rows, which run only with
``--model``), in their order, and its last line must count them. Its figures are a dated run's output
(``docs/benchmarks.md``, "The default run: 25 examples per row"); this test does not run ``verify``.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# One table line: the row's label, then examples, passed, max ULP, CP excess, comm moved/min (and FAILED).
TABLE_LINE = re.compile(r"^(?P<label>.*?)\s+\d+\s+\d+\s+\S+\s+\S+\s+\S+(?:\s+FAILED|\s+skipped)?$")


def readme_verify_sample(text: str) -> list[str]:
    """The lines of the README's fenced block that holds verify's table (from its first line to its last)."""
    blocks, block = [], None
    for line in text.splitlines():
        if line.startswith("```") and block is None:  # an opening fence
            block = []
        elif line.startswith("```"):
            blocks.append(block)
            block = None
        elif block is not None:
            block.append(line)
    sample = next((b for b in blocks if b and b[0].startswith("cp_harness verify: implementation")), None)
    assert sample is not None, "README.md has no fenced block starting with verify's first line"
    return sample


def table_labels(sample: list[str]) -> list[str]:
    """The first column of the table: the lines between the header's dashes and the examples summary."""
    dashes = next(i for i, line in enumerate(sample) if line and set(line) == {"-"})
    labels = []
    for line in sample[dashes + 1:]:
        match = TABLE_LINE.match(line)
        if match is None:
            break
        labels.append(match["label"])
    return labels


def test_the_readme_verify_table_lists_the_declared_rows_in_order():
    from cp_harness.verify import default_rows

    declared = [row.name for row in default_rows() if not row.spec.needs_model]
    sample = readme_verify_sample(README.read_text(encoding="utf-8"))
    assert table_labels(sample) == declared, (
        "README.md's verify table must list the rows verify prints, in order: paste the output of "
        "./scripts/verify --examples 25 --seed 0 and date the run in docs/benchmarks.md")
    assert sample[-1] == f"all {len(declared)} rows passed", sample[-1]


def test_the_table_parser_reads_labels_with_digits_and_stops_at_the_summary():
    sample = ["cp_harness verify: implementation 'x'", "function / model   examples", "-" * 20,
              "sharder verbs: every ShardLayout field, rank 2-5, seq_dim 1/2       30      30     exact         -  -",
              "model: Inkling2-mini (float64)      25      25       437     0.287               -   FAILED",
              "417 examples in 28.6 s; examples per world size: N=1: 88", "all 2 rows passed"]
    assert table_labels(sample) == ["sharder verbs: every ShardLayout field, rank 2-5, seq_dim 1/2",
                                    "model: Inkling2-mini (float64)"]
