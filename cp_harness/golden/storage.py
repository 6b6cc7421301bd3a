"""Golden files on disk: deterministic bytes, a manifest that records and seals them, loading that
verifies every byte and never executes code (``numpy.load(..., allow_pickle=False)``)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from cp_harness.cases.descriptions import GENERATOR_VERSION, canonical, case_id
from cp_harness.golden.contents import (
    ARRAY_FILES,
    CASES,
    FORMAT_VERSION,
    GOLDEN_DIR,
    IMPL_FILE,
    MANIFEST,
    ORACLE_FILE,
    REGENERATE,
    ZIP_DATE,
    GoldenError,
    _fail,
    _jsonable,
    numerics_platform,
    rank_outputs,
)


def _normalize(arr: np.ndarray, where: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.hasobject:
        raise GoldenError(f"{where}: object arrays would need pickle; golden files hold numeric arrays only")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.array(arr, order="C", copy=True)  # (np.ascontiguousarray would turn 0-d arrays into 1-d)


def encode_npz(arrays: dict[str, np.ndarray]) -> bytes:
    """An ``.npz`` archive with a byte-for-byte deterministic encoding (stored entries, sorted, fixed date)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, _normalize(arrays[name], name), version=(1, 0), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def _array_specs(arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    return {name: {"dtype": str(np.asarray(a).dtype), "shape": list(np.shape(a))} for name, a in sorted(arrays.items())}


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _dump_json(value, indent: int = 0) -> str:
    """JSON with sorted keys and indent 2, but lists without objects inside on one line (readable shapes and layouts)."""
    pad, inner = " " * indent, " " * (indent + 2)

    def flat(v) -> bool:
        return not isinstance(v, dict) and (not isinstance(v, list) or all(flat(x) for x in v))

    if isinstance(value, dict):
        if not value:
            return "{}"
        if all(not isinstance(v, (dict, list)) for v in value.values()):
            one_line = json.dumps(value, sort_keys=True, separators=(", ", ": "))
            if len(one_line) <= 60:
                return one_line
        items = [f"{inner}{json.dumps(str(k))}: {_dump_json(value[k], indent + 2)}" for k in sorted(value)]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and not flat(value):
        return "[\n" + ",\n".join(inner + _dump_json(v, indent + 2) for v in value) + "\n" + pad + "]"
    return json.dumps(value, separators=(", ", ": "))


def seal_manifest(manifest: dict) -> bytes:
    """The manifest's file bytes: its own SHA-256 added, sorted keys, indent 2, trailing newline."""
    manifest = dict(manifest)
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    return (_dump_json(manifest) + "\n").encode()


def build_files(
    name: str,
    case: dict,
    oracle: dict[str, np.ndarray],
    impl: dict[str, np.ndarray],
    rules: dict[str, dict],
    rank_info: list[dict],
    *,
    implementation: str = "cp_impl",
    backend: str = "gloo",
    torch_version: str | None = None,
) -> dict[str, bytes]:
    """Every file of one golden case, as bytes: ``{"manifest.json": ..., "oracle.npz": ..., "impl.npz": ...}``."""
    blobs = {ORACLE_FILE: encode_npz(oracle), IMPL_FILE: encode_npz(impl)}
    impl_specs = _array_specs(impl)
    for array, spec in impl_specs.items():
        spec["ranks"] = rules[array]
    manifest = {
        "about": "CP harness golden case: oracle.npz holds the oracle's reference arrays, impl.npz the ranks' results "
        "combined in rank order. Do not edit; regenerate with: " + REGENERATE,
        "name": name,
        "case": _jsonable(case),
        "case_id": case_id(case),
        "check": case["check"],
        "dtype": case.get("dtype", "float64"),
        "world_size": int(case["world_size"]),
        "generator_version": GENERATOR_VERSION,
        "format_version": FORMAT_VERSION,
        "torch_version": torch_version or torch.__version__,
        "numerics_platform": numerics_platform(),
        "produced_by": {"implementation": implementation, "backend": backend},
        "rank_info": _jsonable(rank_info),
        "files": {
            ORACLE_FILE: {
                "sha256": hashlib.sha256(blobs[ORACLE_FILE]).hexdigest(),
                "size": len(blobs[ORACLE_FILE]),
                "arrays": _array_specs(oracle),
            },
            IMPL_FILE: {
                "sha256": hashlib.sha256(blobs[IMPL_FILE]).hexdigest(),
                "size": len(blobs[IMPL_FILE]),
                "arrays": impl_specs,
            },
        },
    }
    return {MANIFEST: seal_manifest(manifest), **blobs}


@dataclasses.dataclass
class Golden:
    """One loaded, verified golden case."""

    name: str
    path: Path
    manifest: dict
    oracle: dict[str, np.ndarray]
    impl: dict[str, np.ndarray]

    @property
    def case(self) -> dict:
        return self.manifest["case"]

    @property
    def rules(self) -> dict[str, dict]:
        return {k: v["ranks"] for k, v in self.manifest["files"][IMPL_FILE]["arrays"].items()}

    def rank_outputs(self) -> list:
        return rank_outputs(self.impl, self.rules, self.manifest["rank_info"])


_REQUIRED_KEYS = (
    "name",
    "case",
    "check",
    "dtype",
    "generator_version",
    "format_version",
    "torch_version",
    "numerics_platform",
    "produced_by",
    "rank_info",
    "files",
    "manifest_sha256",
)


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise _fail(path, "missing")
    raw = path.read_bytes()
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"not valid JSON ({exc}); truncated or edited by hand") from None
    if not isinstance(manifest, dict):
        raise _fail(path, "not a JSON object; edited by hand")
    if "format_version" in manifest and manifest["format_version"] != FORMAT_VERSION:
        raise _fail(path, f"format version {manifest['format_version']}, this harness reads {FORMAT_VERSION}")
    missing = [k for k in _REQUIRED_KEYS if k not in manifest]
    if missing:
        raise _fail(path, f"lacks {', '.join(missing)}; edited by hand or written by another tool")
    if manifest["manifest_sha256"] != _manifest_digest(manifest):
        raise _fail(path, "edited: its content no longer matches its own manifest_sha256")
    if seal_manifest({k: v for k, v in manifest.items() if k != "manifest_sha256"}) != raw:
        raise _fail(path, "edited: not in the canonical layout the generator writes (sorted keys, indent 2)")
    if manifest["format_version"] != FORMAT_VERSION:
        raise _fail(path, f"format version {manifest['format_version']}, this harness reads {FORMAT_VERSION}")
    files = manifest["files"]
    if not isinstance(files, dict) or sorted(files) != sorted(ARRAY_FILES):
        listed = sorted(files) if isinstance(files, dict) else files
        raise _fail(path, f"lists files {listed!r}, expected {sorted(ARRAY_FILES)}")
    return manifest


def _read_arrays(path: Path, entry: dict) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise _fail(path, "missing (listed in manifest.json)")
    raw = path.read_bytes()
    if len(raw) != entry.get("size"):
        what = "truncated" if len(raw) < entry.get("size", 0) else "longer than recorded"
        raise _fail(path, f"{what}: {len(raw)} bytes, manifest.json records {entry.get('size')}")
    digest = hashlib.sha256(raw).hexdigest()
    if digest != entry.get("sha256"):
        raise _fail(
            path, f"SHA-256 mismatch (edited or corrupted): {digest}, manifest.json records {entry.get('sha256')}"
        )
    specs = entry.get("arrays", {})
    for array, spec in specs.items():
        if "O" in str(spec.get("dtype")) or str(spec.get("dtype")) == "object":
            raise _fail(path, f"array {array!r} has dtype {spec.get('dtype')}: it would need pickle to load; refused")
    arrays: dict[str, np.ndarray] = {}
    try:
        loaded = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as exc:
        raise _fail(path, f"refused: {exc} (a golden file must load without pickle)") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _fail(path, f"not a readable .npz archive ({exc})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise _fail(path, "not an .npz archive")
    with loaded:
        if sorted(loaded.files) != sorted(specs):
            raise _fail(path, f"holds arrays {sorted(loaded.files)}, manifest.json lists {sorted(specs)}")
        for array in loaded.files:
            try:
                value = loaded[array]
            except ValueError as exc:
                raise _fail(path, f"array {array!r} refused: {exc} (it would need pickle to load)") from None
            except (OSError, EOFError, zipfile.BadZipFile) as exc:
                raise _fail(path, f"array {array!r} unreadable ({exc})") from None
            spec = specs[array]
            if str(value.dtype) != spec.get("dtype") or list(value.shape) != spec.get("shape"):
                raise _fail(
                    path,
                    f"array {array!r} is {value.dtype} {list(value.shape)}, "
                    f"manifest.json records {spec.get('dtype')} {spec.get('shape')}",
                )
            arrays[array] = value
    return arrays


def load(name: str, root: Path | str = GOLDEN_DIR, *, expected_case: dict | None = None) -> Golden:
    """Load and verify ``root/name``; ``GoldenError`` naming the file on any problem.

    ``expected_case`` (default: ``CASES[name]`` when ``name`` is canonical)
    must equal the case recorded in the manifest.
    """
    folder = Path(root) / name
    manifest_path = folder / MANIFEST
    manifest = _read_manifest(manifest_path)
    if manifest["name"] != name:
        raise _fail(manifest_path, f"names case {manifest['name']!r} but lies in folder {name!r}")
    if expected_case is None:
        expected_case = CASES.get(name)
    if expected_case is not None and canonical(manifest["case"]) != canonical(expected_case):
        raise _fail(
            manifest_path,
            f"records case {canonical(manifest['case'])}, but cp_harness.golden.CASES[{name!r}] "
            f"is {canonical(expected_case)}",
        )
    if manifest["generator_version"] != GENERATOR_VERSION:
        raise _fail(
            manifest_path,
            f"made with generator version {manifest['generator_version']}, "
            f"cp_harness.cases.descriptions.GENERATOR_VERSION is now {GENERATOR_VERSION}",
        )
    oracle = _read_arrays(folder / ORACLE_FILE, manifest["files"][ORACLE_FILE])
    impl = _read_arrays(folder / IMPL_FILE, manifest["files"][IMPL_FILE])
    n = int(manifest["case"]["world_size"])
    if not isinstance(manifest["rank_info"], list) or len(manifest["rank_info"]) != n:
        raise _fail(manifest_path, f"rank_info must list {n} ranks")
    for array, spec in manifest["files"][IMPL_FILE]["arrays"].items():
        rule = spec.get("ranks")
        ok = (
            rule == {"combine": "stack"}
            and impl[array].shape[:1] == (n,)
            or isinstance(rule, dict)
            and rule.get("combine") == "concat"
            and isinstance(rule.get("axis"), int)
            and 0 <= rule["axis"] < impl[array].ndim
            and impl[array].shape[rule["axis"]] % n == 0
        )
        if not ok:
            raise _fail(
                manifest_path,
                f"impl array {array!r}: rank combination {rule!r} does not fit shape "
                f"{list(impl[array].shape)} and {n} ranks",
            )
    return Golden(name=name, path=folder, manifest=manifest, oracle=oracle, impl=impl)
