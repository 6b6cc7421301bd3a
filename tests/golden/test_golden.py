"""Golden files: the current oracle and implementation against the pinned results (docs/golden.md).

Each canonical case runs once on the rank pool (any backend: the nightly NCCL
run compares GPU results with the CPU-made files) and is compared three ways:
current oracle vs golden oracle, current implementation vs golden
implementation (bit for bit for data movement, within the ULP budget
otherwise), and the check's own verdict on both the golden and the current
implementation results. With ``--update-golden`` the same tests rewrite the
files that changed and print what changed.

Textual expectations (shard layouts, who sends what to whom) use expecttest:
``EXPECTTEST_ACCEPT=1`` rewrites the inline strings below.
"""

from __future__ import annotations

import collections
import json

import expecttest
import numpy as np
import pytest
import torch

from cp_harness import checks, golden
from cp_harness.checks.transport import upstream_gradient
from cp_harness import run_summary
from cp_harness.cases.descriptions import PATCH_SIZE, canonical, padded_length
from oracle.models import Inkling2Config

NAMES = list(golden.CASES)


class _UpdateSummary:
    """Prints what ``--update-golden`` did in its own section at the end of the run."""

    def __init__(self, changes: list[golden.Change]):
        self.changes = changes

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.section("golden files (--update-golden)")
        for line in golden.summarize(self.changes).splitlines():
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def update_log(request):
    """Collects what ``--update-golden`` did; the summary is printed at the end of the run."""
    changes: list[golden.Change] = []
    yield changes
    if changes:
        manager, key = request.config.pluginmanager, "cp_harness_golden_update_summary"
        if manager.has_plugin(key):
            manager.get_plugin(key).changes.extend(changes)
        else:
            manager.register(_UpdateSummary(changes), key)


@pytest.mark.parametrize("name", NAMES)
def test_golden_case(name, cp_runner, cp_world_sizes, request, update_log):
    case = golden.CASES[name]
    if int(case["world_size"]) > max(cp_world_sizes):
        pytest.skip(f"needs CP size {case['world_size']}; this run has at most {max(cp_world_sizes)}")
    backend = cp_runner.config.backend
    outputs = cp_runner.run_outputs(case)
    if request.config.getoption("--update-golden"):
        try:
            update_log.append(golden.regenerate(name, case, outputs, implementation=cp_runner.impl, backend=backend))
        except golden.GoldenError as exc:
            pytest.fail(str(exc), pytrace=False)
        return
    try:
        pinned = golden.load(name)
    except golden.GoldenError as exc:
        pytest.fail(str(exc), pytrace=False)
    verdict = golden.verify(pinned, outputs, implementation=cp_runner.impl, backend=backend)
    run_summary.count("golden cases compared")
    if verdict.bit_identical:
        run_summary.count("golden cases bit-identical to a fresh regeneration")
    assert verdict.ok, verdict.format()


def test_golden_folder_holds_exactly_the_canonical_cases(request, update_log):
    if request.config.getoption("--update-golden"):
        update_log.extend(golden.remove_stale())
        return
    stale = golden.stale_folders()
    assert not stale, f"golden folders {stale} are not in cp_harness.golden.CASES; regenerate with: {golden.REGENERATE}"


def test_golden_oracle_is_the_checks_own_oracle():
    """One oracle: a golden file holds what the check's own ``expect`` computes. In bfloat16 the gradient of a
    gather is the float32 sum of every rank's contribution rounded once (the contract); a running bfloat16 sum
    (what a second, hand-written golden extraction once did) rounds differently on this case."""
    name = "gather_sequence-n3-bfloat16"
    case = golden.CASES[name]
    expected = checks.expect(case)
    assert np.array_equal(golden.oracle_arrays(case)["expected_grad"], checks.to_numpy(expected["total"]))
    assert np.array_equal(golden.load(name).oracle["expected_grad"], checks.to_numpy(expected["total"]))
    shape = (1, 2 * int(case["world_size"]), 3)
    running = sum(upstream_gradient(case, r, shape) for r in range(int(case["world_size"])))
    assert running.dtype == torch.bfloat16
    assert not np.array_equal(checks.to_numpy(running), golden.oracle_arrays(case)["expected_grad"])


def _image_positions(case: dict) -> list[tuple[int, int]]:
    images = case["batch"].get("images")
    if not images:
        return []
    if case.get("model", "inkling2") == "inkling2":
        return [(row, start + i) for row, start, h, w in images for i in range((h // PATCH_SIZE) * (w // PATCH_SIZE))]
    return [(row, start + i) for row, start, length in images["spans"] for i in range(length)]


def test_canonical_cases_cover_the_issue():
    cases = list(golden.CASES.values())
    assert len(cases) >= 12
    assert {"gather_sequence", "gather_tokens", "convolution_history", "inkling2_layout", "mistral_large4_layout",
            "shifted_cp_loss", "model"} <= {c["check"] for c in cases}
    assert {c["model"] for c in cases if c["check"] == "model"} == {"inkling2", "mistral_large4"}
    assert {1, 2, 3, 4, 8} <= {int(c["world_size"]) for c in cases}
    assert {"thd", "bshd"} <= {c["batch"]["format"] for c in cases if "batch" in c}
    assert {"thd", "bshd"} <= {c["batch"]["format"] for c in cases if c["check"] == "model"}
    assert any(c["batch"].get("eos_is_pad") for c in cases if "batch" in c)

    # Widths longer than a shard: the halo spans several ranks, on its own and inside inkling2-mini.
    assert any(int(c["width"]) - 1 > int(c["shape"][1]) for c in cases if c["check"] == "convolution_history")
    width = Inkling2Config().conv_width
    assert any(width - 1 > padded_length(c["batch"]["seq_len"], c["world_size"]) // c["world_size"]
               for c in cases if c["check"] == "model" and c["model"] == "inkling2" and c["world_size"] > 1)

    # Images whose tokens lie on two ranks, for both models.
    crossing = set()
    for c in cases:
        if "batch" not in c or int(c["world_size"]) == 1:
            continue
        local = padded_length(c["batch"]["seq_len"], c["world_size"]) // c["world_size"]
        owners = collections.defaultdict(set)
        for row, pos in _image_positions(c):
            owners[row].add(pos // local)
        if any(len(o) > 1 for o in owners.values()):
            crossing.add((c["check"], c.get("model")))
    assert {("model", "inkling2"), ("model", "mistral_large4")} <= crossing

    for name, case in golden.CASES.items():
        assert name.replace("-", "").replace("_", "").isalnum(), f"{name!r} is not a plain folder name"
        assert canonical(case) == canonical(json.loads(canonical(case))), "cases must be plain JSON"


# ------------------------------------------------------------------------------------ textual expectations
def _run(runner, case: dict):
    outputs = runner.run_outputs(case)
    failed = [o for o in outputs if not o.ok]
    assert not failed, f"rank {failed[0].rank} raised {failed[0].error_type}: {failed[0].message}"
    return outputs


def _cells(values, padding=None, *, mark: str) -> str:
    """``star``: value, ``*`` after padding; ``dot``: ``.`` for padding; ``label``: ``.`` for padding, ``-`` for -100."""
    out = []
    for i, v in enumerate(values):
        v = int(v)
        pad = padding is not None and bool(padding[i])
        if mark == "star":
            out.append(f"{v}*" if pad else str(v))
        elif mark == "dot" or (mark == "label" and pad):
            out.append("." if pad else str(v))
        else:
            out.append("-" if v == -100 else str(v))
    return " ".join(out)


class TestTextualExpectations(expecttest.TestCase):
    """Readable pinned layouts and communication; ``EXPECTTEST_ACCEPT=1`` rewrites the expected strings."""

    @pytest.fixture(autouse=True)
    def _pool(self, cp_runner, cp_world_sizes):
        self.runner = cp_runner
        self.max_n = max(cp_world_sizes)

    def _need(self, *sizes: int) -> None:
        if max(sizes) > self.max_n:
            self.skipTest(f"needs CP size {max(sizes)}; this run has at most {self.max_n}")

    def _is_bundled(self) -> bool:
        return self.runner.impl == "cp_impl"

    def test_shard_layouts(self):
        """Which global positions each rank owns: one document from position 0, so positions are global indices.

        ``*`` marks divisibility padding (its positions keep counting).
        """
        sizes = [(4, 1), (7, 2), (10, 3), (10, 4), (5, 8)]
        self._need(*(n for _, n in sizes))
        lines = []
        for S, N in sizes:
            case = {"check": "inkling2_layout", "world_size": N, "seed": 0, "model": "inkling2", "num_chunks": 1,
                    "batch": {"format": "bshd", "seq_len": S, "rows": [[0, S]]}}
            outputs = _run(self.runner, case)
            local = padded_length(S, N) // N
            ranks = [f"rank {o.rank}: {_cells(o.tensors['position_ids'][0], o.tensors['padding_mask'][0], mark='star')}"
                     for o in outputs]
            lines.append(f"S={S} N={N} ({local} per rank): " + " | ".join(ranks))
        self.assertExpectedInline("\n".join(lines), """\
S=4 N=1 (4 per rank): rank 0: 0 1 2 3
S=7 N=2 (4 per rank): rank 0: 0 1 2 3 | rank 1: 4 5 6 7*
S=10 N=3 (4 per rank): rank 0: 0 1 2 3 | rank 1: 4 5 6 7 | rank 2: 8 9 10* 11*
S=10 N=4 (3 per rank): rank 0: 0 1 2 | rank 1: 3 4 5 | rank 2: 6 7 8 | rank 3: 9 10* 11*
S=5 N=8 (1 per rank): rank 0: 0 | rank 1: 1 | rank 2: 2 | rank 3: 3 | rank 4: 4 | rank 5: 5* | rank 6: 6* | rank 7: 7*""")

    def test_packed_layout_per_rank(self):
        """mistral_large4, one packed row per micro-batch: what each rank holds.

        ``.``: padding (positions and labels there are unspecified), ``-``: label -100 (each document's first
        token, so the shifted loss never predicts one document from another).
        """
        self._need(4)
        case = {"check": "mistral_large4_layout", "world_size": 4, "seed": 3, "model": "mistral_large4",
                "num_chunks": 1, "shard_primary": True,
                "batch": {"format": "thd", "seq_len": 10, "docs": [[[1, 1], [3, 4], [4, 4]]]}}
        lines = []
        for o in _run(self.runner, case):
            pad = o.tensors["padding_mask"][0]
            lines.append(f"rank {o.rank}: positions {_cells(o.tensors['position_ids'][0], pad, mark='dot')}"
                         f" | documents {_cells(o.tensors['document_ids'][0], mark='plain')}"
                         f" | labels {_cells(o.tensors['labels'][0], pad, mark='label')}")
        self.assertExpectedInline("\n".join(lines), """\
rank 0: positions 0 0 1 | documents 0 1 1 | labels - - -
rank 1: positions 2 . 0 | documents 1 1 2 | labels 13 . -
rank 2: positions 1 2 3 | documents 2 2 2 | labels 36 10 35
rank 3: positions . . . | documents -1 -1 -1 | labels . . .""")

    def test_convolution_halo_plan(self):
        """Who sends which global rows to whom for ``convolution_history`` (the contract), and what the ranks recorded."""
        configs = [(2, 3, 2), (3, 2, 4), (4, 1, 5), (8, 2, 4), (3, 2, 1)]
        self._need(*(n for n, _, _ in configs))
        plan_lines, recorded_lines = [], []
        for N, L, W in configs:
            plan = golden.halo_plan(N, L, W)
            text = "; ".join(f"{src}->{dst} rows {rows}" for src, dst, rows in plan) or "nothing"
            plan_lines.append(f"N={N} L={L} W={W}: {text}")
            case = {"check": "convolution_history", "world_size": N, "seed": 1, "dtype": "float64",
                    "shape": [1, L, 2], "width": W}
            outputs = _run(self.runner, case)
            recorded_lines.append(f"N={N} L={L} W={W}")
            for o in outputs:
                recorded_lines.append(f"  rank {o.rank}: {golden.format_comm(o.comm)}")
                # Forward: rank r sends its rows to later ranks; backward: it returns the gradients of the rows it got.
                expected = sorted([2 * len(rows) for src, _, rows in plan if src == o.rank]
                                  + [2 * len(rows) for _, dst, rows in plan if dst == o.rank])
                sent = sorted(c["numel"] for c in o.comm if c["op"] == "isend")
                if self._is_bundled():
                    self.assertEqual(sent, expected, f"rank {o.rank} point-to-point sends disagree with the plan")
        self.assertExpectedInline("\n".join(plan_lines), """\
N=2 L=3 W=2: 0->1 rows [2]
N=3 L=2 W=4: 0->1 rows [0, 1]; 0->2 rows [1]; 1->2 rows [2, 3]
N=4 L=1 W=5: 0->1 rows [0]; 0->2 rows [0]; 0->3 rows [0]; 1->2 rows [1]; 1->3 rows [1]; 2->3 rows [2]
N=8 L=2 W=4: 0->1 rows [0, 1]; 0->2 rows [1]; 1->2 rows [2, 3]; 1->3 rows [3]; 2->3 rows [4, 5]; 2->4 rows [5]; 3->4 rows [6, 7]; 3->5 rows [7]; 4->5 rows [8, 9]; 4->6 rows [9]; 5->6 rows [10, 11]; 5->7 rows [11]; 6->7 rows [12, 13]
N=3 L=2 W=1: nothing""")
        if not self._is_bundled():
            self.skipTest("recorded calls are pinned for the bundled cp_impl only")
        self.assertExpectedInline("\n".join(recorded_lines), """\
N=2 L=3 W=2
  rank 0: all_gather int64 x16, isend float64 x2, irecv float64 x2
  rank 1: all_gather int64 x16, irecv float64 x2, isend float64 x2
N=3 L=2 W=4
  rank 0: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x4, irecv float64 x2
  rank 1: all_gather int64 x16, isend float64 x4, irecv float64 x4, isend float64 x4, irecv float64 x4
  rank 2: all_gather int64 x16, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4
N=4 L=1 W=5
  rank 0: all_gather int64 x16, isend float64 x2, isend float64 x2, isend float64 x2, irecv float64 x2, irecv float64 x2, irecv float64 x2
  rank 1: all_gather int64 x16, isend float64 x2, isend float64 x2, irecv float64 x2, isend float64 x2, irecv float64 x2, irecv float64 x2
  rank 2: all_gather int64 x16, isend float64 x2, irecv float64 x2, irecv float64 x2, isend float64 x2, isend float64 x2, irecv float64 x2
  rank 3: all_gather int64 x16, irecv float64 x2, irecv float64 x2, irecv float64 x2, isend float64 x2, isend float64 x2, isend float64 x2
N=8 L=2 W=4
  rank 0: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x4, irecv float64 x2
  rank 1: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x4, isend float64 x4, irecv float64 x4, irecv float64 x2
  rank 2: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4, irecv float64 x4, irecv float64 x2
  rank 3: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4, irecv float64 x4, irecv float64 x2
  rank 4: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4, irecv float64 x4, irecv float64 x2
  rank 5: all_gather int64 x16, isend float64 x4, isend float64 x2, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4, irecv float64 x4, irecv float64 x2
  rank 6: all_gather int64 x16, isend float64 x4, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4, irecv float64 x4
  rank 7: all_gather int64 x16, irecv float64 x2, irecv float64 x4, isend float64 x2, isend float64 x4
N=3 L=2 W=1
  rank 0: all_gather int64 x16
  rank 1: all_gather int64 x16
  rank 2: all_gather int64 x16""")

    def test_gather_and_loss_communication(self):
        """What each rank sends for a differentiable gather and for the shifted loss (bundled implementation)."""
        self._need(3, 4)
        if not self._is_bundled():
            self.skipTest("recorded calls are pinned for the bundled cp_impl only")
        lines = []
        cases = [
            ("gather_sequence N=3 local [2,2,3]", {"check": "gather_sequence", "world_size": 3, "seed": 1,
                                                  "dtype": "float64", "shape": [2, 2, 3], "differentiable": True}),
            ("gather_tokens N=3 local [4,2] int64, not differentiable",
             {"check": "gather_tokens", "world_size": 3, "seed": 1, "dtype": "float64", "shape": [4, 2],
              "differentiable": False, "value_dtype": "int64"}),
            ("shifted_cp_loss N=4 B=1 S=8 V=5", {"check": "shifted_cp_loss", "world_size": 4, "seed": 1,
                                                "model": "mistral_large4", "dtype": "float64", "vocab": 5,
                                                "batch": {"format": "bshd", "seq_len": 8, "rows": [[0, 8]]}}),
        ]
        for title, case in cases:
            lines.append(title)
            for o in _run(self.runner, case):
                lines.append(f"  rank {o.rank}: {golden.format_comm(o.comm)}")
        self.assertExpectedInline("\n".join(lines), """\
gather_sequence N=3 local [2,2,3]
  rank 0: all_gather int64 x16, all_gather float64 x12, reduce_scatter float64 x12
  rank 1: all_gather int64 x16, all_gather float64 x12, reduce_scatter float64 x12
  rank 2: all_gather int64 x16, all_gather float64 x12, reduce_scatter float64 x12
gather_tokens N=3 local [4,2] int64, not differentiable
  rank 0: all_gather int64 x16, all_gather int64 x8
  rank 1: all_gather int64 x16, all_gather int64 x8
  rank 2: all_gather int64 x16, all_gather int64 x8
shifted_cp_loss N=4 B=1 S=8 V=5
  rank 0: all_gather int64 x16, irecv int64 x1, all_reduce int64 x1
  rank 1: all_gather int64 x16, isend int64 x1, irecv int64 x1, all_reduce int64 x1
  rank 2: all_gather int64 x16, isend int64 x1, irecv int64 x1, all_reduce int64 x1
  rank 3: all_gather int64 x16, isend int64 x1, all_reduce int64 x1""")


def test_halo_plan_matches_the_contract_by_brute_force():
    """``golden.halo_plan`` (used for the textual plan) against a direct reading of the contract."""
    for N in range(1, 9):
        for L in range(1, 4):
            for W in range(1, 12):
                plan = golden.halo_plan(N, L, W)
                got = collections.defaultdict(list)
                for src, dst, rows in plan:
                    assert all(src * L <= g < (src + 1) * L for g in rows)
                    got[dst] += rows
                for dst in range(N):
                    wanted = [g for g in range(dst * L - (W - 1), dst * L) if g >= 0]
                    assert sorted(got[dst]) == wanted
                assert all(src < dst for src, dst, _ in plan)
                assert all(len(rows) > 0 for _, _, rows in plan)
