"""Golden storage: damaged, edited or unsafe files are refused by name; regeneration is deterministic.

Every failure mode works on a copy of a committed golden case in ``tmp_path``:
a truncated file, a flipped byte, an edited manifest, a dropped file and an
archive that would need pickle each give a ``GoldenError`` naming the file and
the regeneration command.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_harness import golden
from cp_harness.golden import storage as golden_storage

NAME = "shifted_cp_loss-n4-thd"  # small, and both files hold float and integer arrays


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the committed golden case ``NAME``; returns its folder (the root is its parent)."""
    shutil.copytree(golden.GOLDEN_DIR / NAME, tmp_path / NAME)
    return tmp_path / NAME


def _error(folder: Path) -> str:
    with pytest.raises(golden.GoldenError) as info:
        golden.load(NAME, folder.parent)
    message = str(info.value)
    assert golden.REGENERATE in message, message
    return message


def _manifest(folder: Path) -> dict:
    return json.loads((folder / golden.MANIFEST).read_text())


def _replace_array_file(folder: Path, filename: str, data: bytes, *, arrays: dict | None = None) -> None:
    """Put ``data`` in place of ``filename`` and reseal the manifest so that size and SHA-256 match: only
    the content itself can then be wrong."""
    (folder / filename).write_bytes(data)
    manifest = _manifest(folder)
    del manifest["manifest_sha256"]
    entry = manifest["files"][filename]
    entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    if arrays is not None:
        entry["arrays"] = arrays
    (folder / golden.MANIFEST).write_bytes(golden.seal_manifest(manifest))


def test_the_copy_loads(copy):
    pinned = golden.load(NAME, copy.parent)
    assert set(pinned.oracle) == {"loss", "grad", "count"}
    assert pinned.manifest["torch_version"] and pinned.manifest["generator_version"] >= 1


# ----------------------------------------------------------------------------------------- failure modes
@pytest.mark.parametrize("filename", golden.ARRAY_FILES)
def test_truncated_array_file(copy, filename):
    path = copy / filename
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = _error(copy)
    assert str(path) in message and "truncated" in message


def test_truncated_manifest(copy):
    path = copy / golden.MANIFEST
    path.write_bytes(path.read_bytes()[:200])
    message = _error(copy)
    assert str(path) in message and "not valid JSON" in message


@pytest.mark.parametrize("filename", golden.ARRAY_FILES)
def test_flipped_byte_in_an_array_file(copy, filename):
    path = copy / filename
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    message = _error(copy)
    assert str(path) in message and "SHA-256 mismatch" in message


def test_flipped_byte_in_the_manifest(copy):
    path = copy / golden.MANIFEST
    text = path.read_text()
    path.write_text(text.replace('"seed": 111', '"seed": 110'))  # one bit: '1' -> '0'
    message = _error(copy)
    assert str(path) in message and "edited" in message


@pytest.mark.parametrize("edit", ["torch_version", "dtype", "array_shape", "reformatted"])
def test_edited_manifest(copy, edit):
    path = copy / golden.MANIFEST
    manifest = _manifest(copy)
    if edit == "torch_version":
        manifest["torch_version"] = "9.9.9"
    elif edit == "dtype":
        manifest["dtype"] = "float32"
    elif edit == "array_shape":
        manifest["files"][golden.ORACLE_FILE]["arrays"]["grad"]["shape"] = [1, 8, 6]
    if edit == "reformatted":
        path.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")  # same content, other layout
    else:
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    message = _error(copy)
    assert str(path) in message and "edited" in message


def test_edited_and_resealed_manifest_still_fails(copy):
    """Someone edits the manifest and recomputes its own checksum: the content checks still catch it."""
    path = copy / golden.MANIFEST
    for change, expected in [
        (lambda m: m["case"].__setitem__("seed", 5), "cp_harness.golden.CASES"),
        (lambda m: m.__setitem__("generator_version", 0), "generator version"),
        (lambda m: m["files"][golden.ORACLE_FILE]["arrays"]["grad"].__setitem__("dtype", "float32"), "records float32"),
        (lambda m: m["files"][golden.IMPL_FILE].__setitem__("sha256", "0" * 64), "SHA-256 mismatch"),
    ]:
        shutil.rmtree(copy)
        shutil.copytree(golden.GOLDEN_DIR / NAME, copy)
        manifest = _manifest(copy)
        del manifest["manifest_sha256"]
        change(manifest)
        path.write_bytes(golden.seal_manifest(manifest))
        message = _error(copy)
        assert expected in message, message


@pytest.mark.parametrize("filename", [golden.MANIFEST, *golden.ARRAY_FILES])
def test_dropped_file(copy, filename):
    (copy / filename).unlink()
    message = _error(copy)
    assert str(copy / filename) in message and "missing" in message


def test_dropped_case_folder(tmp_path):
    with pytest.raises(golden.GoldenError, match=f"{NAME}/manifest.json: missing") as info:
        golden.load(NAME, tmp_path)
    assert golden.REGENERATE in str(info.value)


def _npz_with(arrays: dict, *, pickled: dict | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, value in {**arrays, **(pickled or {})}.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, value, allow_pickle=True)
            zf.writestr(f"{name}.npy", member.getvalue())
    return buf.getvalue()


def test_object_array_needing_pickle_is_refused(copy):
    """An archive whose array would need pickle is refused, whether or not the manifest admits it."""
    pinned = golden.load(NAME, copy.parent)
    evil = np.array([{"x": 1}, None], dtype=object)
    data = _npz_with({"grad": pinned.oracle["grad"], "count": pinned.oracle["count"]}, pickled={"loss": evil})
    specs = golden_storage._array_specs(pinned.oracle)

    _replace_array_file(copy, golden.ORACLE_FILE, data, arrays=specs)  # manifest says float64: np.load refuses
    message = _error(copy)
    assert str(copy / golden.ORACLE_FILE) in message and "pickle" in message and "'loss'" in message

    specs["loss"] = {"dtype": "object", "shape": [2]}  # manifest admits it: refused before loading
    _replace_array_file(copy, golden.ORACLE_FILE, data, arrays=specs)
    message = _error(copy)
    assert str(copy / golden.ORACLE_FILE) in message and "pickle" in message and "refused" in message


def test_a_pickle_in_place_of_the_archive_is_refused(copy):
    data = pickle.dumps({"loss": np.zeros(())})
    _replace_array_file(copy, golden.IMPL_FILE, data)
    message = _error(copy)
    assert str(copy / golden.IMPL_FILE) in message and "pickle" in message


def test_archive_with_other_arrays_than_the_manifest(copy):
    pinned = golden.load(NAME, copy.parent)
    data = golden.encode_npz({**pinned.oracle, "extra": np.zeros(3)})
    _replace_array_file(copy, golden.ORACLE_FILE, data)
    message = _error(copy)
    assert str(copy / golden.ORACLE_FILE) in message and "extra" in message


def test_encoding_refuses_object_arrays():
    with pytest.raises(golden.GoldenError, match="pickle"):
        golden.encode_npz({"bad": np.array([None, 1], dtype=object)})


# ---------------------------------------------------------------------------------------- determinism
def test_encoding_is_deterministic_and_plain_numpy():
    rng = np.random.default_rng(0)
    arrays = {"b.grad": rng.standard_normal((2, 3)), "a": np.arange(5, dtype=np.int64), "s": np.asarray(1.5),
              "m": rng.standard_normal((2, 2)).astype(np.float32) > 0, "big": np.arange(4, dtype=">i4")}
    first = golden.encode_npz(arrays)
    assert first == golden.encode_npz(dict(reversed(list(arrays.items()))))
    with zipfile.ZipFile(io.BytesIO(first)) as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == sorted(f"{k}.npy" for k in arrays)
        assert all(i.date_time == golden.ZIP_DATE and i.compress_type == zipfile.ZIP_STORED for i in infos)
    with np.load(io.BytesIO(first), allow_pickle=False) as loaded:
        for name, value in arrays.items():
            assert loaded[name].shape == value.shape and np.array_equal(loaded[name], value)
    assert golden.encode_npz({"s": np.asarray(2.0)}) != golden.encode_npz({"s": np.asarray([2.0])})  # 0-d kept


def test_every_committed_manifest_is_canonical():
    for name in golden.CASES:
        raw = (golden.GOLDEN_DIR / name / golden.MANIFEST).read_bytes()
        manifest = json.loads(raw)
        assert golden.seal_manifest({k: v for k, v in manifest.items() if k != "manifest_sha256"}) == raw
        assert raw.endswith(b"\n") and manifest["name"] == name


# One case per kind of result, small CP sizes included so that a reduced --cp-world-sizes still runs some.
DETERMINISM = ["gather_sequence-n1-nomesh", "convolution_history-n8-width4-local2",
               "mistral_large4_layout-n8-thd-global-primary", "shifted_cp_loss-n3-bshd-eos-float32",
               "model-mistral_large4-n2-bshd-eos-float32", "model-mistral_large4-n3-thd-image-chunks2",
               "model-inkling2-n8-thd-image-eos"]


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def test_regenerating_twice_changes_nothing(cp_runner, cp_world_sizes, tmp_path):
    names = [n for n in DETERMINISM if golden.CASES[n]["world_size"] <= max(cp_world_sizes)]
    if cp_runner.config.backend != "gloo" or not names:
        pytest.skip("goldens are regenerated on CPU (gloo) with every CP size they need")
    lines: list[str] = []
    first = golden.update(names, tmp_path, runner=cp_runner, out=lines.append)
    assert [c.status for c in first] == ["new"] * len(names)
    before = _snapshot(tmp_path)
    second = golden.update(names, tmp_path, runner=cp_runner, out=lines.append)
    assert [c.status for c in second] == ["unchanged"] * len(names)
    assert _snapshot(tmp_path) == before  # same bytes, and not even rewritten
    assert lines[-1] == f"golden files: 0 of {len(names)} cases changed"
    if cp_runner.impl == "cp_impl":
        # Same PyTorch, CPU kernels and implementation as the committed files: regenerating reproduces them
        # byte for byte (another processor may change the last bits of float results: judged within budgets).
        for name in names:
            committed = golden.load(name)
            if committed.manifest["numerics_platform"] == golden.numerics_platform():
                for filename in golden.ARRAY_FILES:
                    assert (tmp_path / name / filename).read_bytes() == (golden.GOLDEN_DIR / name / filename).read_bytes()


def test_update_rewrites_only_what_changed_and_says_by_how_much(cp_runner, copy):
    case = golden.CASES[NAME]
    outputs = cp_runner.run_outputs(case)
    # Oracle and implementation as THIS machine computes them (another CPU family computes other last bits
    # than the one that recorded the committed files), then one element a few ULP off: a "new PyTorch" sized
    # change. Only impl.npz may change, and by exactly that element, on any platform.
    impl, rules, rank_info = golden.impl_arrays(case, outputs)
    impl["grad"][0, 1, 2] *= 1 + 2e-15
    files = golden.build_files(NAME, case, golden.oracle_arrays(case), impl, rules, rank_info, torch_version="0.0.0")
    for filename in (golden.ORACLE_FILE, golden.IMPL_FILE, golden.MANIFEST):
        (copy / filename).write_bytes(files[filename])
    oracle_mtime = (copy / golden.ORACLE_FILE).stat().st_mtime_ns

    verdict = golden.verify(golden.load(NAME, copy.parent), outputs, implementation=cp_runner.impl,
                            backend=cp_runner.config.backend)
    assert verdict.ok and verdict.bit_identical is False  # within budget, but not the same bytes
    assert any("PyTorch 0.0.0" in note for note in verdict.notes)

    change = golden.regenerate(NAME, case, outputs, copy.parent, implementation=cp_runner.impl,
                               backend=cp_runner.config.backend)
    assert change.status == "rewritten"
    assert change.files == [golden.IMPL_FILE, golden.MANIFEST]
    assert (copy / golden.ORACLE_FILE).stat().st_mtime_ns == oracle_mtime
    assert len(change.details) == 1 and change.details[0].startswith("impl grad: 1 of 40 elements changed")
    assert "ULP" in change.details[0] and "max |change|" in change.details[0]
    assert "rewritten" in golden.summarize([change])
    assert golden.regenerate(NAME, case, outputs, copy.parent, implementation=cp_runner.impl,
                             backend=cp_runner.config.backend).status == "unchanged"


def test_a_changed_result_fails_naming_the_array(cp_runner, copy):
    """Beyond the budget (or any change in data movement) the comparison fails and says where."""
    case = golden.CASES[NAME]
    pinned = golden.load(NAME, copy.parent)
    oracle = {k: v.copy() for k, v in pinned.oracle.items()}
    oracle["count"] = oracle["count"] + 1
    impl = {k: v.copy() for k, v in pinned.impl.items()}
    impl["grad"][0, 4, 0] += 1e-6
    files = golden.build_files(NAME, case, oracle, impl, pinned.rules, pinned.manifest["rank_info"])
    for filename, data in files.items():
        (copy / filename).write_bytes(data)
    verdict = golden.verify(golden.load(NAME, copy.parent), cp_runner.run_outputs(case),
                            implementation=cp_runner.impl, backend=cp_runner.config.backend)
    assert not verdict.ok
    text = verdict.format()
    assert "oracle count" in text and "impl grad" in text and "global position 4, owned by rank 2" in text
    assert golden.REGENERATE in text


def test_update_refuses_to_pin_a_failing_implementation(cp_runner, tmp_path):
    case = golden.CASES[NAME]
    outputs = cp_runner.run_outputs(case)
    outputs[0].tensors["grad"] = outputs[0].tensors["grad"] + 1.0
    with pytest.raises(golden.GoldenError, match="refusing to pin"):
        golden.regenerate(NAME, case, outputs, tmp_path)
    assert not (tmp_path / NAME).exists()
    with pytest.raises(golden.GoldenError, match="made on CPU"):
        golden.regenerate(NAME, case, cp_runner.run_outputs(case), tmp_path, backend="nccl")


def test_command_line_check_names_the_damaged_file(copy, capsys):
    assert golden.main(["check", "--storage-only", "--dir", str(copy.parent), "-k", NAME]) == 0
    assert "ok   " + NAME in capsys.readouterr().out
    (copy / golden.IMPL_FILE).unlink()
    assert golden.main(["check", "--storage-only", "--dir", str(copy.parent), "-k", NAME]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {NAME}" in out and str(copy / golden.IMPL_FILE) in out and "missing" in out


def test_stale_folders_are_reported_and_removed(tmp_path):
    (tmp_path / "not-a-case").mkdir()
    assert golden.stale_folders(tmp_path) == ["not-a-case"]
    assert [c.name for c in golden.remove_stale(tmp_path)] == ["not-a-case"]
    assert golden.stale_folders(tmp_path) == []
