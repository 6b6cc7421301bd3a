"""The real-client gate (``examples/automodel``, ``docs/real_clients.md``).

- How a run is judged (no framework needed): a failing row is a documented defect only with its
  documented signature (gradients wrong, no rank raised); anything else is a new finding.
- With nemo-automodel importable (``scripts/real_clients`` installs it; skipped otherwise): every
  adapter loads as an implementation, serves exactly the framework callables it names, leaves the rest
  to ``cp_impl``, and translates arguments as documented (checked with a spy in place of the framework);
  each repro script fails while the defect shows and passes with ``--fixed``. That every documented adapter
  case still fails through the harness with its signature is asserted where each is exported
  (``tests/repro/test_repros.py``: one run of each case serves both).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from examples.automodel.adapters import ADAPTERS
from examples.automodel.tools import defects
from examples.automodel.tools import run as real_clients

# The subjects whose CP path these tests run and judge (examples/automodel/tools/coverage.py reads it).
JUDGES = ("adapter:deepseek_v41_gather", "adapter:kimi_linear_gather", "adapter:blockdiag_gather",
          "adapter:qwen3_8_flash_next_halo", "adapter:shard_batch_load_balanced", "adapter:shard_batch_aux_only",
          "adapter:shard_batch_identity")

ROOT = Path(__file__).resolve().parents[2]
REPRO = ROOT / "examples" / "automodel" / "repro"


def _framework_importable() -> bool:
    try:
        importlib.import_module("nemo_automodel")
    except Exception:  # noqa: BLE001
        return False
    return True


needs_framework = pytest.mark.skipif(
    not _framework_importable(),
    reason="nemo-automodel does not import here (scripts/real_clients installs the pinned version with --no-deps)")


# ---------------------------------------------------------------- judging a run (no framework needed)

def _row(name: str, failing: list[str], problem: bool = False) -> dict:
    """A verify row as the JSON report has it; a failing tensor is a gradient when its name says so here."""
    return {"name": name, "ok": not failing and not problem, "examples": 3, "passed": 2, "max_ulp": 1e17,
            "comparison": "ulp", "comm_ratio": None,
            "failing_tensors": [{"name": n, "gradient": n.startswith(("grad", "input-embedding gradient"))}
                                for n in failing],
            "problems": [{"message": "rank 0 raised ValueError", "detail": "", "rank": 0, "kind": "rank raised"}]
            if problem else [],
            "failure": ("  PROBLEM: rank 0 raised ValueError\n" if problem else "") + "\n".join(failing)}


def _entry(signature, **fields) -> dict:
    return {"id": "D9", "title": "t", "classification": "framework defect", "subject": "adapter:a", "adapter": "a",
            "row": "model: M", "backends": ["gloo"], "signature": signature, **fields}


KNOWN = [_entry(defects.GradientsWrong())]


def test_documented_row_with_its_signature_is_documented():
    report = {"rows": [_row("model: M", ["grad wk", "input-embedding gradient"])]}
    verdicts = real_clients.judge("adapter:a", report, KNOWN, "gloo")
    assert [v["defect"] for v in verdicts] == ["D9"] and "documented framework defect D9" in verdicts[0]["why"]


@pytest.mark.parametrize("row,subject,backend", [
    (_row("model: M", ["logits", "grad wk"]), "adapter:a", "gloo"),           # the forward is wrong too: not D9
    (_row("model: M", [], problem=True), "adapter:a", "gloo"),                # a rank raised: a crash, not D9
    (_row("model: M", ["grad wk"], problem=True), "adapter:a", "gloo"),
    (_row("inkling2.gather_sequence", ["grad@rank0"]), "adapter:a", "gloo"),  # another row
    (_row("model: M", ["grad wk"]), "adapter:b", "gloo"),                     # another adapter
    (_row("model: M", ["grad wk"]), "spec:a", "gloo"),                        # a spec of the same name
    (_row("model: M", ["grad wk"]), "adapter:a", "nccl"),                     # documented for gloo only
])
def test_anything_else_is_a_new_finding(row, subject, backend):
    verdicts = real_clients.judge(subject, {"rows": [row]}, KNOWN, backend)
    assert len(verdicts) == 1 and verdicts[0]["defect"] is None, verdicts


def test_the_tensor_and_problem_signatures_match_only_their_failures():
    tensors = [_entry(defects.TensorsWrong(("position_ids (divisibility padding",)))]
    ok = _row("model: M", ["position_ids (divisibility padding keeps counting)"])
    assert real_clients.judge("adapter:a", {"rows": [ok]}, tensors, "gloo")[0]["defect"] == "D9"
    assert real_clients.judge("adapter:a", {"rows": [_row("model: M", ["labels (real tokens)"])]}, tensors,
                              "gloo")[0]["defect"] is None
    said = [_entry(defects.ProblemSaid(("rank 0 raised ValueError",)))]
    assert real_clients.judge("adapter:a", {"rows": [_row("model: M", [], problem=True)]}, said, "gloo")[0]["defect"] == "D9"
    assert real_clients.judge("adapter:a", {"rows": [_row("model: M", ["grad wk"])]}, said, "gloo")[0]["defect"] is None


class _Report:
    """What ``known_failure`` reads of a ``CaseReport``: its failing comparisons and its problems."""

    def __init__(self, failing: list[str], problem: bool = False):
        row = _row("model: M", failing, problem)
        self._tensors = row["failing_tensors"]
        self.problems = [types.SimpleNamespace(message=p["message"], detail=p["detail"]) for p in row["problems"]]

    def failures(self):
        return [types.SimpleNamespace(as_dict=lambda t=t: t) for t in self._tensors]


def test_a_failure_a_documented_defect_explains_is_not_shrunk_and_any_other_is():
    """The gate's ``VerifySettings.known_failure``: the same entry and signature as ``judge``, asked about a row's
    first failing case; a reason (not shrunk) only where ``judge`` would call the row documented."""
    explained = real_clients.known_failure("adapter:a", KNOWN, "gloo")
    reason = explained("model: M", {}, _Report(["grad wk"]))
    assert reason is not None and "D9" in reason and "replayed" in reason, reason
    assert explained("model: M", {}, _Report(["logits", "grad wk"])) is None  # another signature: shrunk
    assert explained("model: M", {}, _Report([], problem=True)) is None
    assert explained("inkling2.gather_sequence", {}, _Report(["grad wk"])) is None  # another row
    assert real_clients.known_failure("adapter:b", KNOWN, "gloo")("model: M", {}, _Report(["grad wk"])) is None
    assert real_clients.known_failure("adapter:a", KNOWN, "nccl")("model: M", {}, _Report(["grad wk"])) is None
    packed = [_entry(defects.GradientsWrong(), when={"batch.kind": "packed"})]
    only_packed = real_clients.known_failure("adapter:a", packed, "gloo")
    assert only_packed("model: M", {"batch": {"kind": "packed"}}, _Report(["grad wk"])) is not None
    assert only_packed("model: M", {"batch": {"kind": "plain"}}, _Report(["grad wk"])) is None


def test_passing_rows_give_no_verdict_and_the_table_marks_failures():
    report = {"rows": [_row("inkling2.gather_sequence", []), _row("model: M", ["grad wk"])]}
    report["rows"][0].update(comparison="exact", comm_ratio=1.0)
    assert [v["row"] for v in real_clients.judge("adapter:a", report, KNOWN, "gloo")] == ["model: M"]
    table = real_clients.markdown_table(report).splitlines()
    assert table[2] == "| inkling2.gather_sequence | 3 | 2 | exact | 1.00 |"
    assert table[3] == "| **model: M: FAILED** | 3 | 2 | 1e+17 | - |"


def test_every_documented_row_names_a_subject_a_repro_a_reason_and_a_case():
    from examples.automodel.models import SPECS

    rows = real_clients.load_known()
    assert rows
    for defect in rows:
        assert defect.get("adapter") in ADAPTERS or (defect.get("spec") or defect.get("training")) in SPECS, defect
        assert (ROOT / defect["repro"]).is_file()
        assert {"check", "world_size", "seed"} <= set(defect["case"])
        assert (ROOT / defect["doc"].split("#")[0]).is_file()
        assert len(defect["why"]) > 20, defect


def _defects_file(tmp_path, defects) -> Path:
    path = tmp_path / "known.json"
    path.write_text(json.dumps({"about": "test", "defects": defects}))
    return path


def _defect(**changes) -> dict:
    defect = {"id": "D9", "title": "t", "classification": "c", "doc": "d", "repro": "r", "backends": ["gloo"],
              "signature": {"kind": "gradients"},
              "rows": [{"adapter": "a", "row": "model: M", "why": "w", "case": {"check": "model"}}]}
    defect.update(changes)
    return defect


@pytest.mark.parametrize("defects,message", [
    ([_defect(rows=[])], "lists no row"),
    ([{k: v for k, v in _defect().items() if k != "backends"}], "has no backends"),
    ([_defect(rows=[{"adapter": "a", "row": "model: M", "case": {}}])], "rows[0] has no why"),
    ([_defect(rows=[{"row": "model: M", "why": "w", "case": {}}])], "rows[0] has no adapter (or spec)"),
    ([_defect(signature={"kind": "vibes"})], "signature {'kind': 'vibes'}; give"),
    ([_defect(), _defect(id="D8")], "listed by both D9 and D8"),
])
def test_a_malformed_defects_file_is_refused_naming_the_entry_and_field(tmp_path, defects, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        real_clients.load_known(_defects_file(tmp_path, defects))


def test_each_row_a_defect_reaches_is_one_documented_entry(tmp_path):
    rows = [{"adapter": "a", "row": f"model: M ({d})", "why": "w", "case": {"dtype": d}} for d in ("f64", "bf16")]
    known = real_clients.load_known(_defects_file(tmp_path, [_defect(rows=rows)]))
    assert [(k["id"], k["row"], k["case"]) for k in known] == [("D9", "model: M (f64)", {"dtype": "f64"}),
                                                             ("D9", "model: M (bf16)", {"dtype": "bf16"})]
    report = {"rows": [_row("model: M (f64)", ["grad wk"]), _row("model: M (bf16)", ["grad wk"])]}
    assert [v["defect"] for v in real_clients.judge("adapter:a", report, known, "gloo")] == ["D9", "D9"]
    assert [v["defect"] for v in real_clients.judge("adapter:a", report, known[:1], "gloo")] == ["D9", None]


# ----------------------------------------------------------------------- adapters (framework needed)

class _FakeMesh:
    """A 1-D CP mesh of two ranks, seen from CP rank 1; ``get_group`` returns a marker."""

    GROUP = object()

    def size(self):
        return 2

    def get_group(self):
        return self.GROUP

    def get_local_rank(self):
        return 1


def _resolve(dotted: str):
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@needs_framework
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_serves_the_framework_function_and_cp_impl_the_rest(adapter):
    import cp_impl
    from cp_harness.cases.implementation import REQUIRED, load_impl

    module = importlib.import_module(f"examples.automodel.adapters.{adapter}")
    impl = load_impl(f"examples.automodel.adapters.{adapter}")
    owner = getattr(module.FRAMEWORK_FUNCTION, "__self__", module.FRAMEWORK_FUNCTION)  # Function.apply -> its class
    assert owner.__module__.startswith("nemo_automodel."), owner
    for served, dotted in module.SERVES.items():
        assert _resolve(dotted) is owner, (served, dotted)
    for part, functions in REQUIRED.items():
        for fn in functions:
            mine, bundled = getattr(getattr(impl, part), fn), getattr(getattr(cp_impl, part), fn)
            if f"{part}.{fn}" in module.SERVES:
                assert mine is not bundled and mine is getattr(getattr(module, part), fn)
            else:
                assert mine is bundled, f"{adapter} changed {part}.{fn}, which it does not serve"


@needs_framework
@pytest.mark.parametrize("adapter", ["kimi_linear_gather", "deepseek_v41_gather", "blockdiag_gather"])
@pytest.mark.parametrize("differentiable", [True, False])
def test_gather_adapters_translate_mesh_dims_and_the_flag(monkeypatch, adapter, differentiable):
    module = importlib.import_module(f"examples.automodel.adapters.{adapter}")
    calls = []

    def spy(tensor, group, *args, **kwargs):
        dim = kwargs.get("dim", args[0] if args else 1)
        calls.append((tuple(tensor.shape), group, dim, torch.is_grad_enabled()))
        shape = list(tensor.shape)
        shape[dim] *= 2
        return torch.zeros(shape)

    monkeypatch.setattr(module, "FRAMEWORK_FUNCTION", spy)
    mesh = _FakeMesh()
    tokens = module.mistral_large4.gather_tokens(torch.ones(3, 4, 5), mesh, differentiable)   # [T, ...]
    sequence = module.inkling2.gather_sequence(torch.ones(2, 3, 4), mesh, differentiable)    # [B, L, ...]
    assert tokens.shape == (6, 4, 5) and sequence.shape == (2, 6, 4)
    if adapter == "deepseek_v41_gather":  # gathers along dim 1 only: tokens travel as [1, T, ...]
        assert [c[:3] for c in calls] == [((1, 3, 4, 5), mesh.GROUP, 1), ((2, 3, 4), mesh.GROUP, 1)]
    else:
        assert [c[:3] for c in calls] == [((3, 4, 5), mesh.GROUP, 0), ((2, 3, 4), mesh.GROUP, 1)]
    assert [c[3] for c in calls] == [differentiable] * 2
    # One rank: DeepSeek's gather documents group=None as the identity and gets it; the others are not called
    # (their callers skip the gather without CP). Either way the documented result is the input object.
    calls.clear()
    x = torch.ones(2, 3)
    module.inkling2.gather_sequence(x, None, differentiable)
    assert [c[1] for c in calls] == ([None] if adapter == "deepseek_v41_gather" else [])
    monkeypatch.undo()
    assert module.inkling2.gather_sequence(x, None, differentiable) is x
    assert module.mistral_large4.gather_tokens(x, None, differentiable) is x


@needs_framework
def test_halo_adapter_builds_the_framework_context_and_appends_the_shard(monkeypatch):
    module = importlib.import_module("examples.automodel.adapters.qwen3_8_flash_next_halo")
    seen = {}

    def spy(tensor, context, *, history):
        seen.update(rank=context.rank, size=context.size, group=context.group, start=context.local_sequence_start,
                    local=context.local_sequence_length, history=history)
        return torch.full((tensor.shape[0], history, tensor.shape[2]), -1.0)

    monkeypatch.setattr(module, "FRAMEWORK_FUNCTION", spy)
    masked = torch.arange(2 * 3 * 4, dtype=torch.float64).view(2, 3, 4)
    out = module.inkling2.convolution_history(masked, _FakeMesh(), 5)
    assert seen == {"rank": 1, "size": 2, "group": _FakeMesh.GROUP, "start": 3, "local": 3, "history": 4}
    assert out.shape == (2, 7, 4) and torch.equal(out[:, 4:], masked) and bool((out[:, :4] == -1).all())


# ------------------------------------------------------------- repros and the documented case (slow)

REPROS = ["gather_permuted_grad.py", "gather_subgroup.py", "gather_inplace_grad.py", "gather_bf16_accumulation.py",
          "round_robin_pad_positions.py", "round_robin_caller_resized.py", "round_robin_loss_mask.py",
          "round_robin_2d_mesh.py", "eagle_ring_float32_alias.py"]


@needs_framework
@pytest.mark.slow
def test_repros_fail_and_pass_with_the_fix():
    """Each repro's command line, as it is (exit 1, the defect printed) and with ``--fixed`` (exit 0), without
    the harness; ``_launch.py`` runs them all in one interpreter so torch and the framework load once."""
    proc = subprocess.run([sys.executable, str(REPRO / "_launch.py"), *REPROS], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    runs = {(r["script"], r["fixed"]): r for r in map(json.loads, proc.stdout.splitlines())}
    assert sorted(runs) == sorted((s, f) for s in REPROS for f in (False, True)), proc.stdout + proc.stderr
    for script in REPROS:
        broken, fixed = runs[script, False], runs[script, True]
        assert broken["exit"] == 1, broken["output"]
        assert any(word in broken["output"] for word in ("WRONG", "raised", "differ from")), broken["output"]
        assert fixed["exit"] == 0, fixed["output"]
    assert proc.returncode == 0, proc.stderr


@needs_framework
def test_the_d4_cases_pass_under_the_payload_policy_and_fail_under_strict(framework_adapters):
    """D4 (the framework sums bf16/fp16 gradient slices in the payload's precision) is a contract choice, not a
    wrong gradient: every documented D4 case passes under ``--precision-policy payload`` and fails under
    ``strict``, where the other documented defects fail under both."""
    from cp_harness.judging.policy import PAYLOAD, STRICT
    from cp_harness.runner import CaseRunner

    d4 = [d for d in real_clients.load_known() if d["id"] == "D4"]
    assert d4
    config, pool = framework_adapters.config, framework_adapters.pool  # the adapters imported (tests/conftest.py)
    for defect in d4:
        case = {**defect["case"], "impl": f"examples.automodel.adapters.{defect['adapter']}"}
        assert CaseRunner(config, pool=pool, policy=PAYLOAD).run(case).ok, defect
        assert not CaseRunner(config, pool=pool, policy=STRICT).run(case).ok, defect


# ------------------------------------------------ the gate end to end, on a small budget (default command)

GATE_ADAPTERS = ("deepseek_v41_gather",)


@needs_framework
def test_the_gate_on_a_small_budget_calls_only_documented_rows_and_every_documented_row_is_needed(
        own_pool_runner, cp_world_sizes, tmp_path):
    """``examples.automodel.tools.run`` as CI runs it (verify every row of the adapter, judge, replay), at three
    examples per row on warm ranks: status 3, and the rows it calls documented are exactly the
    rows ``known_defects.json`` lists for the adapter. A row added to a check that a documented defect also
    reaches, or a documented row dropped from the file, turns this red here rather than in CI's gate.

    The ranks are the session's size with the adapter imported by their launcher, as the gate's own pool for the
    adapters has it (``tools/pools.py``): its documented rows fail by a rank raising, and the pool starts again
    after each, so each start forks ranks that hold the framework instead of ranks that each import it."""
    if max(cp_world_sizes) < 2:
        pytest.skip("the gate needs a pool of at least two ranks (--cp-world-sizes)")
    sizes = ",".join(str(n) for n in cp_world_sizes)
    adapters = [f"examples.automodel.adapters.{a}" for a in GATE_ADAPTERS]
    with own_pool_runner([{"world_size": max(cp_world_sizes)}], adapters) as runner:
        status = real_clients.main([*GATE_ADAPTERS, "--examples", "3", "--shrink-seconds", "0", "--world-sizes",
                                    sizes, "--reports", str(tmp_path), "--no-coverage"], pool=runner.pool)
    summary = json.loads((tmp_path / "summary.json").read_text())
    verdicts = "\n".join(summary["verdicts"])
    assert status == real_clients.DOCUMENTED_ONLY, verdicts
    documented = {(f["subject"], f["row"]): f["defect"] for f in summary["findings"] if f["defect"]}
    listed = {(k["subject"], k["row"]): k["id"] for k in real_clients.load_known()
              if k["subject"] in {f"adapter:{a}" for a in GATE_ADAPTERS}}
    assert documented == listed, verdicts
    assert all(r["reproduced"] for r in summary["replays"]) and len(summary["replays"]) == len(listed), verdicts
    assert "status 3" in (tmp_path / "summary.md").read_text()
    for subject, row in listed:  # each documented row reports its first failing case, and says why
        rows = json.loads((tmp_path / f"{subject.split(':', 1)[1]}.json").read_text())["rows"]
        assert "replayed" in next(r for r in rows if r["name"] == row)["not_shrunk"], (subject, row)
    # The same run judged with any one documented row left out of the file: that row becomes a new finding.
    known = real_clients.load_known()
    for key in listed:
        report = json.loads((tmp_path / f"{key[0].split(':', 1)[1]}.json").read_text())
        fewer = [k for k in known if (k["subject"], k["row"]) != key]
        verdict = {v["row"]: v["defect"] for v in real_clients.judge(key[0], report, fewer, "gloo")}
        assert verdict[key[1]] is None, (key, verdict)


def test_the_findings_page_lists_every_row_each_defect_reaches():
    """``docs/real_clients.md`` says which rows each defect reaches and why: one table line per documented row."""
    page = (ROOT / "docs" / "real_clients.md").read_text()
    for entry in real_clients.load_known():
        line = f"| {entry['id']} | `{entry.get('adapter') or entry.get('spec') or entry.get('training')}` | {entry['row']} |"
        assert line in page, f"docs/real_clients.md has no line {line!r} (section 'Which rows each defect reaches')"


@needs_framework
def test_every_model_subject_says_whether_it_can_run_here():
    """The gate's loop asks each spec subject for its unmet ``REQUIRES`` before running it; a subject whose module
    the question cannot find crashes the whole gate (torchtitan's specs live outside ``examples.automodel``)."""
    from examples.automodel.tools import coverage

    names = [s.split(":", 1)[1] for s in real_clients._subjects([]) if s.startswith(("spec:", "training:"))]
    assert any(real_clients.spec_module(n).startswith("examples.torchtitan.") for n in names)
    for name in names:
        unmet = coverage.spec_unmet(real_clients.spec_module(name))
        assert unmet is None or unmet.startswith("needs "), (name, unmet)


def test_lanes_put_the_model_specs_beside_the_other_subjects_and_name_a_lane_that_wrote_no_summary(tmp_path):
    """``--lanes 2``: the model specs in one process, every other subject in the other (their pools differ anyway);
    a lane that ends without writing its part of the summary is a subject that could not run, named with its log."""
    from examples.automodel.tools import lanes

    subjects = ["adapter:a", "spec:s", "training:s", "spec:t", "attention:e"]
    assert lanes.split(subjects, 2) == [["spec:s", "spec:t"], ["adapter:a", "training:s", "attention:e"]]
    assert lanes.split(subjects, 1) == [subjects]
    assert lanes.split(["adapter:a"], 2) == [["adapter:a"]]
    done = lanes.run(["--no-such-option"], [["adapter:a"]], tmp_path)  # the lane's argparse exits 2
    assert len(done) == 1 and not done[0]["subjects"], done
    assert done[0]["crashed"][0].startswith("lane 0 (adapter:a): exited 2 without its summary"), done
    assert "--no-such-option" in done[0]["crashed"][0]
