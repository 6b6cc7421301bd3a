"""The gate gates: the main-job command and the gate suite, run as a user runs them.

- ``python -m cp_harness verify`` on the bundled implementation prints the
  table (one row per documented function group, the sharder and each model)
  and exits 0; its ``--json`` report says the same.
- Pointed at a deliberately broken copy (``tests/fixtures/broken_gate_*``) it
  exits 1, marks the right rows FAILED and no others, names the wrong tensor
  and where it is wrong, prints a reproduction command and the path of an
  error map, and the error map is a valid PNG.
- The gate suite (``pytest --pyargs cp_harness.tests``) fails on a broken copy
  and names the tensor.
- ``--backend nccl`` / ``--cp-backend nccl`` without enough GPUs stop at once
  with a message that says what to change.

``verify`` runs in this process on the session's warm ranks (they load the
broken module by name: the root conftest puts ``tests/fixtures`` on their
path), except ``test_verify_command_line``, which runs the command a user types
in a subprocess with a pool of its own; so do the gate-suite runs.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import check_png, error_maps

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"

LOSS_ROW = "mistral_large4.shifted_cp_loss"
MISTRAL_MODEL_ROW = "model: MistralLarge4-mini (float64)"
MISTRAL_BF16_ROW = "model: MistralLarge4-mini (bfloat16)"
HISTORY_ROW = "inkling2.convolution_history"
INKLING2_MODEL_ROW = "model: Inkling2-mini (float64)"
INKLING2_LAYOUT_ROW = "inkling2.prepare_cp_inputs + unpack_row_layout"
INKLING2_BF16_ROW = "model: Inkling2-mini (bfloat16)"
LOSS_MASK_ROW = "sharder.shard(loss_mask=...)"
MISTRAL_LAYOUT_ROW = "mistral_large4.prepare_cp_inputs (BSHD/THD)"
VERBS_ROW = "sharder verbs: every ShardLayout field, rank 2-5, seq_dim 1/2"


def _run(args: list[str], tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CP_IMPL", None)  # the plugin exports the implementation under test; these commands choose their own
    env["PYTHONPATH"] = os.pathsep.join([str(FIXTURES), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["CP_HARNESS_ERROR_MAP_DIR"] = str(tmp_path / "error-maps")
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _table(stdout: str) -> dict[str, bool]:
    """``{row name: failed}`` read off the printed table."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("function / model"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip() or " examples in " in line:
            break
        failed = line.rstrip().endswith("FAILED")
        name = line.split("  ")[0].rstrip()  # names are left-aligned and padded; the numbers follow
        rows[name] = failed
    return rows


def _verify(impl: str, tmp_path: Path, cp_runner, *, world_sizes=(2, 3), examples: int = 4,
            shrink_seconds: float = 1.0, rows: tuple[str, ...] = ()) -> tuple[int, str, dict[str, bool], dict]:
    """``cp_harness verify`` in this process on the session's warm ranks (they load ``impl`` on first use):
    ``(exit code, printed report, {row: failed}, JSON report)``, all from the returned ``VerifyResult`` (the
    row verdicts are read off its rows, not the printed table). The CLI around it runs in
    ``test_verify_command_line``."""
    from cp_harness.verify import VerifySettings, result_text, run_verify

    if max(world_sizes) > cp_runner.config.world_size:
        pytest.skip(f"needs {max(world_sizes)} ranks (--cp-world-sizes)")
    settings = VerifySettings(impl=impl, world_sizes=tuple(world_sizes), examples=examples,
                              backend=cp_runner.config.backend, error_dir=str(tmp_path / "error-maps"),
                              shrink_seconds=shrink_seconds, rows=rows)
    result = run_verify(settings, pool=cp_runner.pool, progress_stream=io.StringIO())
    assert result.cannot_run is None, result.cannot_run
    table = {row.name: not row.ok for row in result.rows}
    return result.exit_code, result_text(result), table, json.loads(json.dumps(result.as_dict()))


def _verify_broken(impl: str, tmp_path: Path, cp_runner, rows: tuple[str, ...] = ()) -> tuple[str, dict[str, bool], dict]:
    """``verify`` on a broken module, exit 1; ``rows``: only the rows whose names contain one of these (the
    model's own rows, where the defect and its consequences must show and the model's other functions must
    still pass)."""
    code, stdout, table, report = _verify(impl, tmp_path, cp_runner, rows=rows)
    assert code == 1, f"exit {code}\n{stdout}"
    return stdout, table, report


def test_verify_passes_on_the_bundled_implementation(tmp_path, cp_runner, cp_world_sizes):
    from cp_harness.verify import default_rows

    code, stdout, table, report = _verify("cp_impl", tmp_path, cp_runner, world_sizes=cp_world_sizes, examples=5,
                                          shrink_seconds=120.0)
    assert code == 0, f"exit {code}\n{stdout}"
    names = [row.name for row in default_rows() if not row.spec.needs_model]  # real-model rows run with --model
    assert list(table) == names, stdout
    assert not any(table.values()), stdout
    assert f"examples per world size: N={min(cp_world_sizes)}:" in stdout and f"N={max(cp_world_sizes)}:" in stdout
    assert "CP excess" in stdout.splitlines()[1]  # the column of cp_harness.judging.excess
    per_dtype = next(line for line in stdout.splitlines() if line.startswith("examples per dtype:"))
    assert "bfloat16:" in per_dtype and "failed per dtype: none" in per_dtype, per_dtype
    assert report["ok"] is True and report["failed_rows"] == [] and report["impl"] == "cp_impl"
    assert [r["name"] for r in report["rows"]] == names
    for row in report["rows"]:
        assert row["examples"] >= 1 and row["passed"] == row["examples"] and row["ok"], row
        assert row["functions"] and row["claimed_but_never_called"] == [], row  # every claim really ran
        assert set(row["called"]) >= {f for f in row["functions"] if not f.endswith("*")}, row
        assert row["comparison"] in ("exact", "ulp")
        if row["comm_ratio"] is not None:
            assert row["comm_ratio"] >= 1.0, row  # nothing moves less than the minimum the contract needs
    assert report["table"] in stdout


def test_verify_command_line(tmp_path):
    """The command a user types: a pool of its own, the progress bar on stderr, the table and the failure on
    stdout, the JSON report, exit 1 for a failing row and only that row failing."""
    report_path = tmp_path / "report.json"
    proc = _run(["-m", "cp_harness", "verify", "--impl", "broken_gate_unpack_eos", "--examples", "3",
                 "--world-sizes", "2,3", "--rows", INKLING2_LAYOUT_ROW, "--shrink-seconds", "3",
                 "--json", str(report_path)], tmp_path)
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "starting 3 ranks" in proc.stderr and ("progress:" in proc.stderr or "[" in proc.stderr), proc.stderr
    assert _table(proc.stdout) == {INKLING2_LAYOUT_ROW: True}, proc.stdout
    assert f"FAILED {INKLING2_LAYOUT_ROW}" in proc.stdout and "reproduce: python -m cp_harness run-case" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and report["failed_rows"] == [INKLING2_LAYOUT_ROW] and report["table"] in proc.stdout
    assert report["impl"] == "broken_gate_unpack_eos"


def test_verify_fails_on_a_loss_divided_by_the_local_count(tmp_path, cp_runner):
    stdout, table, report = _verify_broken("broken_gate_loss_local_count", tmp_path, cp_runner,
                                          rows=("mistral_large4", "MistralLarge4"))
    failed = {name for name, bad in table.items() if bad}
    assert LOSS_ROW in failed, stdout
    assert "mistral_large4.gather_tokens" in table and len(table) == 5, stdout  # the model's rows, all of them
    assert failed <= {LOSS_ROW, MISTRAL_MODEL_ROW, MISTRAL_BF16_ROW}, \
        f"only the loss and the model using it may fail:\n{stdout}"
    assert f"FAILED {LOSS_ROW}" in stdout
    assert "d loss / d logits" in stdout or "loss (mean over ranks)" in stdout
    assert "reproduce: python -m cp_harness run-case --impl broken_gate_loss_local_count" in stdout
    maps = error_maps(stdout)
    assert maps, f"no error map printed:\n{stdout}"
    for path in maps:
        assert path.is_file() and path.parent == tmp_path / "error-maps", path
        check_png(path)
    assert any("d_loss_d_logits" in p.name for p in maps), maps
    loss_row = next(r for r in report["rows"] if r["name"] == LOSS_ROW)
    assert report["ok"] is False and LOSS_ROW in report["failed_rows"]
    assert loss_row["error_maps"] and loss_row["reproduce"] and loss_row["failing_case"]["world_size"] > 1
    assert {t["name"] for t in loss_row["failing_tensors"]} & {"d loss / d logits", "loss (mean over ranks)"}


def test_verify_fails_on_an_unpack_row_layout_that_mistakes_eos_for_padding(tmp_path, cp_runner):
    """The only defect is the documented ``unpack_row_layout`` deciding padding from token ids: the row that
    claims that function fails, naming it, and no other row does."""
    stdout, table, report = _verify_broken("broken_gate_unpack_eos", tmp_path, cp_runner)
    failed = {name for name, bad in table.items() if bad}
    assert failed == {INKLING2_LAYOUT_ROW}, stdout
    assert "unpack_row_layout padding_mask@rank" in stdout and "actual True, expected False" in stdout
    row = next(r for r in report["rows"] if r["name"] == INKLING2_LAYOUT_ROW)
    assert "inkling2.unpack_row_layout" in row["functions"] and "inkling2.unpack_row_layout" in row["called"]
    assert row["failing_case"]["batch"].get("eos_is_pad") and row["failing_case"]["batch"]["format"] == "thd"


def test_verify_fails_on_a_halo_that_drops_the_boundary_row(tmp_path, cp_runner):
    stdout, table, report = _verify_broken("broken_gate_halo", tmp_path, cp_runner, rows=("inkling2", "Inkling2"))
    failed = {name for name, bad in table.items() if bad}
    assert HISTORY_ROW in failed, stdout
    assert "inkling2.gather_sequence" in table and len(table) == 6, stdout  # the model's rows, all of them
    assert failed <= {HISTORY_ROW, INKLING2_MODEL_ROW, INKLING2_BF16_ROW}, \
        f"only the halo and the model using it may fail:\n{stdout}"
    assert "history@rank" in stdout or "gradient returned to each owner" in stdout
    maps = error_maps(stdout)
    assert maps, stdout
    for path in maps:
        check_png(path)
    history_row = next(r for r in report["rows"] if r["name"] == HISTORY_ROW)
    assert any(t["name"].startswith(("history@rank", "gradient returned to each owner")) for t in history_row["failing_tensors"])


def test_verify_fails_packed_document_ids_left_full_length_in_a_model_row_too(tmp_path, cp_runner):
    """Packed document ids that are not sharded: the layout row names the key (a finding, not a crash of the
    judge), and the model, whose packed attention reads the document ids, fails as well."""
    stdout, table, _ = _verify_broken("broken_gate_docs_full_length", tmp_path, cp_runner,
                                      rows=(MISTRAL_LAYOUT_ROW, MISTRAL_MODEL_ROW))
    assert table == {MISTRAL_LAYOUT_ROW: True, MISTRAL_MODEL_ROW: True}, stdout
    assert "document_ids is not sharded like the tokens" in stdout and "harness crashed" not in stdout, stdout


def test_verify_fails_a_sharder_that_pads_labels_with_zero_in_a_model_row_too(tmp_path, cp_runner):
    """Labels padded with 0 instead of -100 at divisibility padding: the layout rows name the positions, and
    the model's loss (masked on the label value alone, as the framework's recipe masks it) changes too."""
    stdout, table, _ = _verify_broken("broken_gate_labels_pad_zero", tmp_path, cp_runner,
                                      rows=(INKLING2_LAYOUT_ROW, INKLING2_MODEL_ROW))
    assert table == {INKLING2_LAYOUT_ROW: True, INKLING2_MODEL_ROW: True}, stdout
    assert "FAIL labels (divisibility padding)" in stdout and "divisibility padding)" in stdout, stdout
    assert "FAIL loss" in stdout, stdout


@pytest.mark.parametrize(("impl", "says"), [
    ("broken_gate_loss_mask_dropped", "its local batch holds no 'loss_mask'"),
    ("broken_gate_loss_mask_padding", "FAIL loss_mask (at the reported index map; padding False / 0)"),
])
def test_verify_fails_on_a_sharder_that_mishandles_the_loss_mask(tmp_path, cp_runner, impl, says):
    """A sharder that drops the caller's loss mask, or pads it with True / 1, fails the loss-mask row (the
    miniature models never read the mask: nothing else would see it)."""
    stdout, table, _ = _verify_broken(impl, tmp_path, cp_runner, rows=("loss_mask",))
    assert table == {LOSS_MASK_ROW: True}, stdout
    assert says in stdout, stdout


@pytest.mark.parametrize(("impl", "says"), [
    ("broken_gate_verbs_seq_dim", "shard_token_tensor"),
    ("broken_gate_verbs_fill", "FAIL shard_token_tensor(form"),
])
def test_verify_fails_on_a_sharder_whose_verbs_mishandle_seq_dim_or_fill(tmp_path, cp_runner, impl, says):
    """A sharder whose ``shard_token_tensor`` takes ``seq_dim=2`` as 1 (mRoPE positions ``[3, B, S]``), or pads
    a caller-length tensor with 0 whatever its ``fill``, fails the verb row (its named examples draw both)."""
    stdout, table, _ = _verify_broken(impl, tmp_path, cp_runner, rows=("sharder_verbs",))  # the row id
    assert table == {VERBS_ROW: True}, stdout
    assert says in stdout, stdout


@pytest.mark.slow
def test_gate_suite_fails_on_the_broken_modules(tmp_path):
    """``pytest --pyargs cp_harness.tests`` judging two broken modules in one run (``--cp-impl a,b``: the loss
    test runs the first, the layout test draws either): both tests fail, each naming its module and tensor.

    - ``broken_gate_loss_local_count``: the loss divided by the local count;
    - ``broken_gate_index_map``: a sharder that cuts load-balanced but reports the contiguous index map.
    """
    proc = _run(["-m", "pytest", "--pyargs", "cp_harness.tests", "--cp-impl",
                 "broken_gate_loss_local_count,broken_gate_index_map", "-q", "-p", "no:cacheprovider",
                 "-k", "test_sharded_layout_matches_oracle or test_shifted_cp_loss_matches_oracle",
                 "--cp-world-sizes", "1,2,3", "--hypothesis-profile", "ci"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 failed" in out, out
    loss = out[out.index("test_shifted_cp_loss_matches_oracle ___"):]
    loss = loss[:loss.index("\n____") if "\n____" in loss else len(loss)]
    assert "d loss / d logits" in loss or "loss (mean over ranks)" in loss, loss
    assert "against implementation 'broken_gate_loss_local_count'" in loss, loss
    layout = out[out.index("test_sharded_layout_matches_oracle ___"):]
    assert "against implementation 'broken_gate_index_map'" in layout, layout
    assert re.search(r"FAIL (labels|padding_mask|position_ids)", layout), layout
    assert "reproduce: python -m cp_harness run-case" in out
    assert "error maps:" in out and "CP examples run:" in out
    maps = [Path(p.strip()) for m in re.finditer(r"^E\s+error maps: (.+)$", out, re.MULTILINE)
            for p in m.group(1).split(", ")]
    assert maps and all(p.suffix == ".png" for p in maps), out
    check_png(maps[-1])
    summary = out[out.index("error maps of the failing cases"):]  # the end-of-run summary lists them again
    assert str(maps[-1]) in summary


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not _no_cuda(), reason="checks the message on a machine without CUDA")
def test_nccl_without_gpus_stops_with_a_clear_message(tmp_path, capsys):
    from cp_harness.__main__ import main

    assert main(["verify", "--backend", "nccl", "--world-sizes", "1,2"]) == 2  # before any rank starts
    err = capsys.readouterr().err
    assert "backend nccl needs CUDA devices" in err and "gloo" in err, err
    # The plugin's pytest_configure check for --cp-backend nccl (a UsageError: pytest exits 4 with the message).
    from types import SimpleNamespace

    from cp_harness.pytest_plugin import _configure_gpus

    config = SimpleNamespace(option=SimpleNamespace(dist="no", tx=None))  # the controller of a run without xdist
    with pytest.raises(pytest.UsageError, match="--cp-backend nccl: backend nccl needs CUDA devices"):
        _configure_gpus(config, 2)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    import torch

    from cp_harness.ranks import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    devices.check_backend("nccl", 4)
    with pytest.raises(devices.DeviceError, match=r"8 ranks need 8 GPUs, but 4 are visible.*at most 4"):
        devices.check_backend("nccl", 8)
    with pytest.raises(devices.DeviceError, match=r"2 ranks x 4 pytest-xdist workers need 8 GPUs.*-n 2"):
        devices.check_backend("nccl", 2, pools=4)
    assert devices.gpu_slice(1, 2) == "2,3"
    devices.check_backend("gloo", 64)  # CPU ranks: no device limit


@pytest.mark.gpu
def test_nccl_pool_gives_every_rank_its_own_gpu(cp_runner, cp_backend):
    """Under ``--cp-backend nccl`` (nightly): one CUDA device per rank, and a case runs across all of them."""
    assert cp_backend == "nccl"
    n = cp_runner.config.world_size
    cp_runner.check({"check": "gather_sequence", "world_size": n, "seed": 1, "dtype": "float32",
                     "shape": [2, 3, 4], "differentiable": True})
    devices = [cp_runner.pool.hello[r]["device"] for r in range(n)]
    assert all(d.startswith("cuda") for d in devices) and len(set(devices)) == n, devices
