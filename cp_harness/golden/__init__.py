"""Golden files: the oracle's and the implementation's results for canonical cases, pinned.

Each canonical case (``CASES``, plain case descriptions that any check or
property test can run) has a folder ``golden/<name>/`` with

- ``oracle.npz``: the oracle's reference arrays (what the check compares the
  ranks with: expected outputs and gradients, layouts, losses);
- ``impl.npz``: what the implementation's ranks returned on a CPU (gloo) pool,
  combined in rank order: token-aligned local tensors concatenated along their
  sequence axis (global order), everything else stacked along a new first axis;
- ``manifest.json``: readable description: the case, its dtype, the generator
  version, the PyTorch version that made the files, how each implementation
  array was combined, each rank's ``info``, the SHA-256 and size of every
  array file, each array's dtype and shape, and a SHA-256 of the manifest itself.

Storage never executes code on load: ``.npz`` archives are read with
``numpy.load(..., allow_pickle=False)``, and every file is checked against the
manifest (present, size, SHA-256, names, dtypes, shapes) before use. Any
problem raises ``GoldenError`` naming the file and how to regenerate.

The files are written deterministically (zip entries uncompressed, in sorted
order, with a fixed date; manifests as sorted, indented JSON), and a case is
rewritten only when its arrays changed, so regenerating twice in a row leaves
every byte as it was.

Command line::

    python -m cp_harness golden check  [-k SUBSTRING] [--impl MODULE] [--backend gloo|nccl] [--storage-only]
    python -m cp_harness golden update [-k SUBSTRING] [--impl MODULE]
    python -m cp_harness golden list

See ``docs/golden.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from cp_harness import checks
from cp_harness.judging.budgets import budget_for
from cp_harness.cases.descriptions import GENERATOR_VERSION, IGNORE_INDEX, canonical, case_id, padded_length
from cp_harness.judging.compare import TensorComparison, TokenGrid, compare

FORMAT_VERSION = 2  # 2: manifests record the numerics platform (float results differ in their last bits across CPUs)
GOLDEN_DIR = Path(os.environ.get("CP_HARNESS_GOLDEN_DIR") or Path(__file__).resolve().parents[2] / "golden")
MANIFEST = "manifest.json"
ORACLE_FILE = "oracle.npz"
IMPL_FILE = "impl.npz"
ARRAY_FILES = (ORACLE_FILE, IMPL_FILE)
REGENERATE = "./scripts/test tests/test_golden.py --update-golden  (or: python -m cp_harness golden update)"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)



def numerics_platform() -> dict[str, str]:
    """What decides the last bits of a float64 result on CPU: the PyTorch build, the SIMD kernels ATen
    dispatches to, and the processor (MKL picks its code path per CPU). Regenerating reproduces golden
    files byte for byte only where all of these match; elsewhere results agree within the budgets."""
    vendor = model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and vendor == "unknown":
                    vendor = value.strip()
                elif key.strip() == "model name" and model == "unknown":
                    model = value.strip()
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": f"{vendor} {model}".strip()}


# Checks whose every output is pure data movement: compared bit for bit. The others are arithmetic:
# their floating-point arrays are compared within cp_harness.judging.budgets, their integer arrays bit for bit.
DATA_MOVEMENT = frozenset({"gather_sequence", "gather_tokens", "convolution_history",
                           "inkling2_layout", "mistral_large4_layout"})

# ------------------------------------------------------------------------------------------------ the cases
# Names are folder names under golden/. Each case is an ordinary case description (cp_harness.cases.descriptions): it can
# be pasted into `python -m cp_harness run-case` or used as a Hypothesis @example, and vice versa.
CASES: dict[str, dict] = {
    # -- inkling2.gather_sequence / mistral_large4.gather_tokens
    "gather_sequence-n1-nomesh": {
        "check": "gather_sequence", "world_size": 1, "mesh": "none", "seed": 101, "dtype": "float64",
        "shape": [2, 3, 4], "differentiable": True},
    "gather_sequence-n4-float32": {
        "check": "gather_sequence", "world_size": 4, "seed": 102, "dtype": "float32",
        "shape": [2, 3, 2], "differentiable": True},
    "gather_tokens-n3": {
        "check": "gather_tokens", "world_size": 3, "seed": 103, "dtype": "float64",
        "shape": [5, 2], "differentiable": True},
    "gather_tokens-n8-int64": {
        "check": "gather_tokens", "world_size": 8, "seed": 104, "dtype": "float64",
        "shape": [2, 3], "differentiable": False, "value_dtype": "int64"},
    # -- inkling2.convolution_history: width - 1 longer than a shard (history spans several ranks)
    "convolution_history-n4-width5-local1": {
        "check": "convolution_history", "world_size": 4, "seed": 105, "dtype": "float64",
        "shape": [2, 1, 3], "width": 5},
    "convolution_history-n8-width4-local2": {
        "check": "convolution_history", "world_size": 8, "seed": 106, "dtype": "float32",
        "shape": [1, 2, 2], "width": 4},
    # -- layouts and sharding
    "inkling2_layout-n3-thd-eos-image": {
        "check": "inkling2_layout", "world_size": 3, "seed": 107, "model": "inkling2", "num_chunks": 1,
        "batch": {"format": "thd", "seq_len": 10, "docs": [[[1, 1], [0, 2], [4, 5]], [[6, 6], [3, 4]]],
                  "eos_is_pad": True, "images": [[1, 3, 2, 4]]}},  # image tokens 3, 4 across the 3|4 boundary
    "inkling2_layout-n2-bshd-chunks2": {
        "check": "inkling2_layout", "world_size": 2, "seed": 108, "model": "inkling2", "num_chunks": 2,
        "batch": {"format": "bshd", "seq_len": 7, "rows": [[3, 4], [0, 5]]}},
    "mistral_large4_layout-n8-thd-global-primary": {
        "check": "mistral_large4_layout", "world_size": 8, "seed": 109, "model": "mistral_large4",
        "num_chunks": 2, "shard_primary": False,
        "batch": {"format": "thd", "seq_len": 9, "docs": [[[2, 3], [5, 5]], [[9, 9]]]}},
    "mistral_large4_layout-n2-bshd-eos": {
        "check": "mistral_large4_layout", "world_size": 2, "seed": 110, "model": "mistral_large4",
        "num_chunks": 1, "shard_primary": True,
        "batch": {"format": "bshd", "seq_len": 7, "rows": [[2, 4], [0, 7]], "eos_is_pad": True}},
    # -- mistral_large4.shifted_cp_loss
    "shifted_cp_loss-n4-thd": {
        "check": "shifted_cp_loss", "world_size": 4, "seed": 111, "model": "mistral_large4", "dtype": "float64",
        "vocab": 5, "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 4], [4, 4]]]}},
    "shifted_cp_loss-n3-bshd-eos-float32": {
        "check": "shifted_cp_loss", "world_size": 3, "seed": 112, "model": "mistral_large4", "dtype": "float32",
        "vocab": 7, "batch": {"format": "bshd", "seq_len": 7, "rows": [[1, 5], [0, 7]], "eos_is_pad": True}},
    # -- the miniature models end to end
    "model-inkling2-n8-thd-image-eos": {
        "check": "model", "world_size": 8, "seed": 113, "model": "inkling2", "dtype": "float64", "num_chunks": 1,
        "batch": {"format": "thd", "seq_len": 13, "docs": [[[1, 1], [6, 7], [0, 1], [3, 3]]],
                  "images": [[0, 3, 2, 4]], "eos_is_pad": True}},  # L=2 < width-1=3; image tokens 3, 4 across 3|4
    "model-inkling2-n4-bshd-image-float32": {
        "check": "model", "world_size": 4, "seed": 117, "model": "inkling2", "dtype": "float32", "num_chunks": 1,
        "batch": {"format": "bshd", "seq_len": 10, "rows": [[1, 9], [3, 6]],
                  "images": [[0, 2, 2, 2], [1, 5, 4, 2]]}},  # second image: tokens 5, 6 across 5|6
    "model-inkling2-n1-bshd": {
        "check": "model", "world_size": 1, "seed": 114, "model": "inkling2", "dtype": "float64", "num_chunks": 1,
        "batch": {"format": "bshd", "seq_len": 6, "rows": [[2, 4], [0, 6]]}},
    "model-mistral_large4-n3-thd-image-chunks2": {
        "check": "model", "world_size": 3, "seed": 115, "model": "mistral_large4", "dtype": "float64",
        "num_chunks": 2, "shard_primary": True,
        "batch": {"format": "thd", "seq_len": 11, "docs": [[[4, 5], [6, 6]], [[11, 11]]],
                  "images": {"height": 2, "width": 4, "spans": [[1, 3, 1], [1, 4, 1]]}}},  # across 3|4
    "model-mistral_large4-n2-bshd-eos-float32": {
        "check": "model", "world_size": 2, "seed": 116, "model": "mistral_large4", "dtype": "float32",
        "num_chunks": 1, "shard_primary": False,
        "batch": {"format": "bshd", "seq_len": 9, "rows": [[4, 5], [0, 9]], "eos_is_pad": True}},
    "model-mistral_large4-n1-nomesh-thd": {
        "check": "model", "world_size": 1, "mesh": "none", "seed": 118, "model": "mistral_large4",
        "dtype": "float64", "num_chunks": 1, "shard_primary": True,
        "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 3], [4, 5]]]}},
}


class GoldenError(Exception):
    """A golden file is missing, damaged, edited, refused (would need pickle) or does not match its manifest."""


def _fail(path: Path | str, problem: str) -> GoldenError:
    return GoldenError(f"golden file {path}: {problem}\nregenerate with: {REGENERATE}")


# ------------------------------------------------------------------------------------- what a golden holds
def _np(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return checks.to_numpy(value)
    return np.asarray(value)


def oracle_arrays(case: dict) -> dict[str, np.ndarray]:
    """The oracle's reference arrays for ``case`` (what its check compares the ranks' results with).

    Computed with one torch thread so that the float64 sums, and the files, are
    the same on every machine whatever its core count."""
    with checks.one_intra_op_thread():
        return _oracle_arrays(case)


def _oracle_arrays(case: dict) -> dict[str, np.ndarray]:
    check = case["check"]
    if check in ("gather_sequence", "gather_tokens"):
        from cp_harness.checks.transport import global_value, upstream_gradient

        seq_dim = 1 if check == "gather_sequence" else 0
        n = int(case["world_size"])
        value = global_value(case, list(case["shape"]), seq_dim)
        out = {"expected_output": _np(value)}
        if bool(case.get("differentiable", True)) and value.is_floating_point():
            out["expected_grad"] = _np(sum(upstream_gradient(case, r, value.shape) for r in range(n)))
        return out
    if check == "convolution_history":
        from cp_harness.checks.transport import global_value, upstream_gradient

        n = int(case["world_size"])
        B, L, C = case["shape"]
        h = int(case["width"]) - 1
        value = global_value(case, [B, L, C], 1)
        padded = torch.cat([torch.zeros(B, h, C, dtype=value.dtype), value], dim=1)
        grad = torch.zeros_like(padded)
        for r in range(n):
            grad[:, r * L:r * L + L + h] += upstream_gradient(case, r, (B, L + h, C))
        history = torch.stack([padded[:, r * L:r * L + L + h] for r in range(n)])
        return {"expected_history": _np(history), "expected_grad": _np(grad[:, h:h + n * L])}
    if check in ("inkling2_layout", "mistral_large4_layout"):
        from cp_harness.checks.layout import expected_layout, pad_sequence

        batch, layout = expected_layout(case)
        # The bundled (contiguous) implementation's padded length: golden files pin that implementation.
        S_pad = padded_length(layout.keep.shape[1], int(case["world_size"]))
        keep = pad_sequence(layout.keep, S_pad, False)
        labels = batch["labels"].clone()
        out = {"keep": _np(keep), "padding_mask": _np(~keep), "position_ids": _np(pad_sequence(layout.positions, S_pad, 0)),
               "input_ids": _np(batch["input_ids"])}
        if check == "mistral_large4_layout" and "seq_lens" in batch:
            first = torch.zeros_like(layout.keep)
            first[:, 0] = True
            first[:, 1:] = layout.document_ids[:, 1:] != layout.document_ids[:, :-1]
            labels = torch.where(first & (layout.document_ids >= 0), IGNORE_INDEX, labels)
            out["document_ids"] = _np(pad_sequence(layout.document_ids, S_pad, -1))
        out["labels"] = _np(pad_sequence(labels, S_pad, IGNORE_INDEX))
        return out
    if check == "shifted_cp_loss":
        from cp_harness.checks.loss import loss_inputs
        from oracle.loss import mean_loss, shifted_cross_entropy

        logits, labels, keep, _ = loss_inputs(case)
        ref_logits = logits.detach().to(torch.float64).requires_grad_(True)
        loss_sum, count = shifted_cross_entropy(ref_logits, labels, keep)
        loss = mean_loss(loss_sum, count)
        loss.backward()
        return {"loss": _np(loss), "grad": _np(ref_logits.grad), "count": np.asarray(int(count), dtype=np.int64)}
    if check == "model":
        from cp_harness.checks.models import oracle_run

        out, params, layout = oracle_run(case)
        arrays = {"logits": _np(out.logits), "loss": _np(out.loss), "inputs_embeds.grad": _np(out.inputs_embeds.grad),
                  "keep": _np(layout.keep), "count": np.asarray(int(out.count), dtype=np.int64)}
        for name, p in params.items():
            arrays[f"grad.{name}"] = _np(p.grad) if p.grad is not None else np.zeros(tuple(p.shape))
        return arrays
    raise GoldenError(f"no golden extraction for check {check!r}; add it to cp_harness.golden.oracle_arrays")


def combine_rule(case: dict, tensor: str) -> dict:
    """How the ranks' local ``tensor`` is combined into one golden array (and split back)."""
    check = case["check"]
    concat = None
    if check == "gather_sequence" or check == "convolution_history":
        concat = 1 if tensor == "grad" else None
    elif check == "gather_tokens":
        concat = 0 if tensor == "grad" else None
    elif tensor in ("token_indices", "token_marker"):  # each rank's [L] index map / sharded arange(S)
        concat = 0
    elif check in ("inkling2_layout", "mistral_large4_layout"):
        # Local [B, L] tensors; input_ids stay global (every rank holds all of them) unless sharded.
        concat = 1 if tensor != "input_ids" or bool(case.get("shard_primary", True)) else None
    elif check == "shifted_cp_loss":
        concat = 1 if tensor == "grad" else None
    elif check == "model":
        concat = 1 if tensor in ("logits", "inputs_embeds.grad") else None
    return {"combine": "stack"} if concat is None else {"combine": "concat", "axis": concat}


def impl_arrays(case: dict, outputs: list) -> tuple[dict[str, np.ndarray], dict[str, dict], list[dict]]:
    """``(arrays, rules, rank_info)`` from the ranks' outputs of ``case``, combined in rank order."""
    failed = [o for o in outputs if not o.ok]
    if failed:
        o = failed[0]
        raise GoldenError(f"case {canonical(case)}: rank {o.rank} raised {o.error_type}: {o.message}")
    names = sorted(outputs[0].tensors)
    for o in outputs:
        if sorted(o.tensors) != names:
            raise GoldenError(f"case {canonical(case)}: rank {o.rank} returned tensors {sorted(o.tensors)}, rank 0 {names}")
    arrays, rules = {}, {}
    for name in names:
        rule = combine_rule(case, name)
        parts = [np.asarray(o.tensors[name]) for o in outputs]
        arrays[name] = np.concatenate(parts, axis=rule["axis"]) if rule["combine"] == "concat" else np.stack(parts)
        rules[name] = rule
    return arrays, rules, [_jsonable(o.info) for o in outputs]


def rank_outputs(arrays: dict[str, np.ndarray], rules: dict[str, dict], rank_info: list[dict]) -> list:
    """Split golden implementation arrays back into per-rank outputs (what ``checks.evaluate`` judges)."""
    from cp_harness.ranks.pool import RankOutput

    n = len(rank_info)
    per_rank: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name, arr in arrays.items():
        rule = rules[name]
        parts = np.split(arr, n, axis=rule["axis"]) if rule["combine"] == "concat" else list(arr)
        for r in range(n):
            per_rank[r][name] = np.array(parts[r], order="C", copy=True)
    return [RankOutput(rank=r, ok=True, info=copy.deepcopy(rank_info[r]), tensors=per_rank[r], comm=[], seconds=0.0)
            for r in range(n)]


def _jsonable(value):
    return json.loads(json.dumps(value, sort_keys=True))


# --------------------------------------------------------------------------------------- deterministic files
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


def build_files(name: str, case: dict, oracle: dict[str, np.ndarray], impl: dict[str, np.ndarray],
                rules: dict[str, dict], rank_info: list[dict], *, implementation: str = "cp_impl",
                backend: str = "gloo", torch_version: str | None = None) -> dict[str, bytes]:
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
            ORACLE_FILE: {"sha256": hashlib.sha256(blobs[ORACLE_FILE]).hexdigest(), "size": len(blobs[ORACLE_FILE]),
                          "arrays": _array_specs(oracle)},
            IMPL_FILE: {"sha256": hashlib.sha256(blobs[IMPL_FILE]).hexdigest(), "size": len(blobs[IMPL_FILE]),
                        "arrays": impl_specs},
        },
    }
    return {MANIFEST: seal_manifest(manifest), **blobs}


# ------------------------------------------------------------------------------------------------- loading
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


_REQUIRED_KEYS = ("name", "case", "check", "dtype", "generator_version", "format_version", "torch_version",
                  "numerics_platform", "produced_by", "rank_info", "files", "manifest_sha256")


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
        raise _fail(path, f"SHA-256 mismatch (edited or corrupted): {digest}, manifest.json records {entry.get('sha256')}")
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
                raise _fail(path, f"array {array!r} is {value.dtype} {list(value.shape)}, "
                                  f"manifest.json records {spec.get('dtype')} {spec.get('shape')}")
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
        raise _fail(manifest_path, f"records case {canonical(manifest['case'])}, but cp_harness.golden.CASES[{name!r}] "
                                   f"is {canonical(expected_case)}")
    if manifest["generator_version"] != GENERATOR_VERSION:
        raise _fail(manifest_path, f"made with generator version {manifest['generator_version']}, "
                                   f"cp_harness.cases.descriptions.GENERATOR_VERSION is now {GENERATOR_VERSION}")
    oracle = _read_arrays(folder / ORACLE_FILE, manifest["files"][ORACLE_FILE])
    impl = _read_arrays(folder / IMPL_FILE, manifest["files"][IMPL_FILE])
    n = int(manifest["case"]["world_size"])
    if not isinstance(manifest["rank_info"], list) or len(manifest["rank_info"]) != n:
        raise _fail(manifest_path, f"rank_info must list {n} ranks")
    for array, spec in manifest["files"][IMPL_FILE]["arrays"].items():
        rule = spec.get("ranks")
        ok = rule == {"combine": "stack"} and impl[array].shape[:1] == (n,) or \
            isinstance(rule, dict) and rule.get("combine") == "concat" and isinstance(rule.get("axis"), int) \
            and 0 <= rule["axis"] < impl[array].ndim and impl[array].shape[rule["axis"]] % n == 0
        if not ok:
            raise _fail(manifest_path, f"impl array {array!r}: rank combination {rule!r} does not fit shape "
                                       f"{list(impl[array].shape)} and {n} ranks")
    return Golden(name=name, path=folder, manifest=manifest, oracle=oracle, impl=impl)


# ---------------------------------------------------------------------------------------------- comparing
# Oracle arrays laid out [batch, global sequence, ...] (the others are scalars, parameters or per-rank stacks).
_ORACLE_TOKEN_ARRAYS = {
    "gather_sequence": {"expected_output", "expected_grad"},
    "convolution_history": {"expected_grad"},
    "inkling2_layout": {"keep", "padding_mask", "position_ids", "labels", "input_ids"},
    "mistral_large4_layout": {"keep", "padding_mask", "position_ids", "labels", "input_ids", "document_ids"},
    "shifted_cp_loss": {"grad"},
    "model": {"logits", "inputs_embeds.grad", "keep"},
}


def _grid(case: dict, kind: str, name: str, arr: np.ndarray) -> TokenGrid | None:
    """The shard grid of a token-aligned array (names the owning rank of a mismatch), else ``None``."""
    n = int(case["world_size"])
    if kind == "impl":
        token = combine_rule(case, name) == {"combine": "concat", "axis": 1}
    else:
        token = name in _ORACLE_TOKEN_ARRAYS.get(case["check"], ())
    if not token or arr.ndim < 2:
        return None
    if "batch" in case:
        S_pad = padded_length(int(case["batch"]["seq_len"]), n)
        return TokenGrid(S_pad // n, n)
    return TokenGrid(arr.shape[1] // n, n) if arr.shape[1] % n == 0 else None


def _impl_mask(case: dict, name: str, arr: np.ndarray, oracle: dict[str, np.ndarray]) -> np.ndarray | None:
    """What the contract specifies of an implementation array (layout: positions on real tokens, ...)."""
    if case["check"] not in ("inkling2_layout", "mistral_large4_layout") or "keep" not in oracle \
            or combine_rule(case, name) != {"combine": "concat", "axis": 1}:
        return None
    keep = np.asarray(oracle["keep"], dtype=bool)
    S = int(case["batch"]["seq_len"])
    if arr.shape[:2] != keep.shape:
        return None
    divisibility = np.zeros_like(keep)
    divisibility[:, S:] = True
    if name == "position_ids":
        return keep
    if name == "labels":
        return keep | divisibility
    if name == "input_ids":
        return ~divisibility
    return None


def _mode(case: dict, arr: np.ndarray) -> str:
    if case["check"] in DATA_MOVEMENT or np.asarray(arr).dtype.kind not in "fc":
        return "exact"
    return "ulp"


def compare_arrays(case: dict, kind: str, actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], *,
                   oracle: dict[str, np.ndarray] | None = None) -> tuple[list[TensorComparison], list[str]]:
    """Compare current arrays with golden ones: ``(comparisons, problems)``.

    ``kind``: ``"oracle"`` (float64 references; arithmetic within the float64
    budget) or ``"impl"`` (the case's dtype and budget; layout arrays only
    where the contract specifies them, using ``oracle["keep"]``).
    """
    comparisons, problems = [], []
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing:
        problems.append(f"{kind}: arrays {missing} are in the golden file but were not produced now")
    if extra:
        problems.append(f"{kind}: arrays {extra} were produced now but are not in the golden file")
    budget_case = {"dtype": "float64"} if kind == "oracle" else case
    ulp_dtype = "float64" if kind == "oracle" else case.get("dtype", "float64")
    for name in sorted(set(actual) & set(expected)):
        a, e = np.asarray(actual[name]), np.asarray(expected[name])
        label = f"{kind} {name}"
        if a.dtype != e.dtype:
            problems.append(f"{label}: dtype {a.dtype} now, {e.dtype} in the golden file")
            continue
        mode = _mode(case, e)
        mask = _impl_mask(case, name, e, oracle or {}) if kind == "impl" else None
        if mask is not None and not mask.any():
            continue
        if mode == "exact":
            comparisons.append(compare(label, a, e, mode="exact", mask=mask, grid=_grid(case, kind, name, e)))
        else:
            budget = budget_for(case["check"], budget_case)
            comparisons.append(compare(label, a, e, mode="ulp", budget_ulp=budget.ulp, floor_fraction=budget.floor_fraction,
                                       mask=mask, grid=_grid(case, kind, name, e), ulp_dtype=ulp_dtype))
    return comparisons, problems


@dataclasses.dataclass
class Verdict:
    """The outcome of comparing one golden case with the current oracle and implementation."""

    name: str
    case: dict
    path: str = ""
    comparisons: list[TensorComparison] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    bit_identical: bool | None = None  # would regenerating change nothing (same bytes)?

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.comparisons)

    def format(self) -> str:
        lines = [f"golden case {self.name!r} ({self.path or self.name}) does not match the current results",
                 f"case: {canonical(self.case)}"]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines += [f"  FAIL {c.summary()}" for c in self.comparisons if not c.ok]
        passed = [c for c in self.comparisons if c.ok]
        if passed:
            lines.append(f"  passed: {len(passed)} of {len(self.comparisons)} array comparisons")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"if the change is intended, regenerate with: {REGENERATE}")
        return "\n".join(lines)


def verify(golden: Golden, outputs: list | None, *, implementation: str = "cp_impl", backend: str = "gloo") -> Verdict:
    """Compare a loaded golden case with the current oracle and (given ``outputs``) the current implementation.

    - current oracle against the golden oracle;
    - current implementation (``outputs`` of a pool run on any backend) against the golden implementation;
    - the check's own verdict on the golden implementation (against the oracle) and on the current one.
    """
    case = golden.case
    verdict = Verdict(name=golden.name, case=case, path=str(golden.path))
    recorded = golden.manifest["torch_version"]
    if recorded != torch.__version__:
        verdict.notes.append(f"the golden files were made with PyTorch {recorded}; this run uses PyTorch {torch.__version__}")
    elif golden.manifest["numerics_platform"] != numerics_platform():
        verdict.notes.append(f"the golden files were made on {golden.manifest['numerics_platform']}; this run is on "
                             f"{numerics_platform()}: float results may differ in their last bits (compared within budgets)")
    made_by = golden.manifest["produced_by"]
    if backend != made_by.get("backend") or implementation != made_by.get("implementation"):
        verdict.notes.append(f"the golden implementation results come from {made_by.get('implementation')!r} on "
                             f"{made_by.get('backend')}; this run judges {implementation!r} on {backend}")
    oracle_now = oracle_arrays(case)
    comps, probs = compare_arrays(case, "oracle", oracle_now, golden.oracle)
    verdict.comparisons += comps
    verdict.problems += probs
    expected = checks.expect(case)  # the oracle once, for both verdicts (it is only read)
    golden_report = checks.evaluate(case, golden.rank_outputs(), expected)
    if not golden_report.ok:
        verdict.problems.append("the check rejects the golden implementation results against the oracle:\n"
                                + golden_report.format())
    if outputs is not None:
        try:
            impl_now, rules, info = impl_arrays(case, outputs)
        except GoldenError as exc:
            verdict.problems.append(str(exc))
            return verdict
        comps, probs = compare_arrays(case, "impl", impl_now, golden.impl, oracle=golden.oracle)
        verdict.comparisons += comps
        verdict.problems += probs
        report = checks.evaluate(case, outputs, expected)
        if not report.ok:
            verdict.problems.append("the check rejects the current implementation against the oracle:\n" + report.format())
        verdict.bit_identical = (encode_npz(oracle_now) == encode_npz(golden.oracle)
                                 and encode_npz(impl_now) == encode_npz(golden.impl) and rules == golden.rules
                                 and info == golden.manifest["rank_info"])
    return verdict


# ---------------------------------------------------------------------------------------------- regenerating
@dataclasses.dataclass
class Change:
    """What regenerating one case did: ``status`` is ``"unchanged"``, ``"new"``, ``"rewritten"``, ``"replaced ..."``
    (the old files did not load: damaged, edited, or the case description changed) or ``"removed ..."``."""

    name: str
    status: str
    files: list[str] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)

    def format(self) -> str:
        head = f"{self.name}: {self.status}"
        if self.files:
            head += f" ({', '.join(self.files)} rewritten)"
        return "\n".join([head] + [f"    {d}" for d in self.details])


def _describe_changes(kind: str, old: dict[str, np.ndarray], new: dict[str, np.ndarray], ulp_dtype: str) -> list[str]:
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in old:
            lines.append(f"{kind} {name}: new array {new[name].dtype} {list(new[name].shape)}")
            continue
        if name not in new:
            lines.append(f"{kind} {name}: removed")
            continue
        a, e = np.asarray(new[name]), np.asarray(old[name])
        if a.dtype != e.dtype or a.shape != e.shape:
            lines.append(f"{kind} {name}: {e.dtype} {list(e.shape)} -> {a.dtype} {list(a.shape)}")
            continue
        if a.tobytes() == e.tobytes():
            continue
        if a.dtype.kind in "fc":
            c = compare(name, a, e, mode="ulp", budget_ulp=math.inf, ulp_dtype=ulp_dtype)
            changed = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
            lines.append(f"{kind} {name}: {changed} of {a.size} elements changed, max |change| {c.max_abs:.3g}, "
                         f"max {c.max_ulp:.3g} ULP")
        else:
            changed = int(np.sum(a != e))
            diff = np.abs(a.astype(np.float64) - e.astype(np.float64)).max() if a.size else 0.0
            lines.append(f"{kind} {name}: {changed} of {a.size} elements changed, max |change| {diff:g}")
    return lines


def _write_if_changed(path: Path, data: bytes) -> bool:
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def regenerate(name: str, case: dict, outputs: list, root: Path | str = GOLDEN_DIR, *,
               implementation: str = "cp_impl", backend: str = "gloo") -> Change:
    """Write ``root/name`` from the current oracle and the ranks' ``outputs``, touching only what changed.

    Refuses (``GoldenError``) when the check itself rejects the outputs (a
    failing implementation is never pinned) or when the outputs did not come
    from a CPU (gloo) pool: goldens are CPU-made.
    """
    if backend != "gloo":
        raise GoldenError(f"golden files are made on CPU (gloo); refusing to regenerate {name!r} from a {backend} run")
    report = checks.evaluate(case, outputs)
    if not report.ok:
        raise GoldenError(f"refusing to pin {name!r}: the check rejects the implementation {implementation!r}:\n"
                          f"{report.format()}")
    oracle = oracle_arrays(case)
    impl, rules, info = impl_arrays(case, outputs)
    folder = Path(root) / name
    old: Golden | None = None
    reason = None
    if (folder / MANIFEST).exists() or any((folder / f).exists() for f in ARRAY_FILES):
        try:
            old = load(name, root, expected_case=case)
        except GoldenError as exc:
            reason = str(exc).splitlines()[0]
    if old is not None:
        same = (encode_npz(oracle) == encode_npz(old.oracle) and encode_npz(impl) == encode_npz(old.impl)
                and rules == old.rules and _jsonable(info) == old.manifest["rank_info"])
        if same:
            return Change(name, "unchanged")
    files = build_files(name, case, oracle, impl, rules, info, implementation=implementation, backend=backend)
    written = [f for f in (ORACLE_FILE, IMPL_FILE, MANIFEST) if _write_if_changed(folder / f, files[f])]
    for stray in sorted(folder.iterdir()):
        if stray.name not in files:
            if stray.is_dir():
                shutil.rmtree(stray)
            else:
                stray.unlink()
            written.append(f"{stray.name} (removed)")
    if old is None:
        details = [reason] if reason else [f"{len(oracle)} oracle arrays, {len(impl)} implementation arrays"]
        return Change(name, "replaced (the old files did not load)" if reason else "new", written, details)
    details = _describe_changes("oracle", old.oracle, oracle, "float64")
    details += _describe_changes("impl", old.impl, impl, case.get("dtype", "float64"))
    if rules != old.rules:
        details.append("rank combination rules changed")
    if _jsonable(info) != old.manifest["rank_info"]:
        details.append("rank info changed")
    return Change(name, "rewritten", written, details)


def stale_folders(root: Path | str = GOLDEN_DIR) -> list[str]:
    """Folders under ``root`` that are not canonical cases."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in CASES and not p.name.startswith("."))


def remove_stale(root: Path | str = GOLDEN_DIR) -> list[Change]:
    changes = []
    for name in stale_folders(root):
        shutil.rmtree(Path(root) / name)
        changes.append(Change(name, "removed (no longer in cp_harness.golden.CASES)"))
    return changes


def summarize(changes: Iterable[Change]) -> str:
    changes = list(changes)
    changed = [c for c in changes if c.status != "unchanged"]
    lines = [f"golden files: {len(changed)} of {len(changes)} cases changed"]
    lines += [c.format() for c in changed]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- textual expectations
def halo_plan(cp_size: int, local_len: int, width: int) -> list[tuple[int, int, list[int]]]:
    """``convolution_history`` by the contract: ``(src, dst, global rows)`` that rank ``src`` must send ``dst``.

    Rank ``dst`` needs the ``width - 1`` global rows before its shard; rows
    before position 0 are zeros (sent by nobody). The gradient of each row
    travels back the same way (``dst`` to ``src``) in the backward.
    """
    h = width - 1
    plan = []
    for dst in range(cp_size):
        rows = [g for g in range(dst * local_len - h, dst * local_len) if g >= 0]
        for src in range(dst):
            mine = [g for g in rows if src * local_len <= g < (src + 1) * local_len]
            if mine:
                plan.append((src, dst, mine))
    return sorted(plan)


def format_comm(calls: list[dict]) -> str:
    """One rank's recorded collective calls as text: ``op dtype x numel``, in call order."""
    return ", ".join(f"{c['op']} {c['dtype']} x{c['numel']}" for c in calls) or "(none)"


# --------------------------------------------------------------------------------------------- command line
def _select(pattern: str | None) -> list[str]:
    names = [n for n in CASES if not pattern or pattern in n]
    if not names:
        raise SystemExit(f"no golden case name contains {pattern!r}; known: {', '.join(CASES)}")
    return names


def _runner(impl: str, backend: str, names: list[str]):
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    return CaseRunner(PoolConfig(world_size=max(int(CASES[n]["world_size"]) for n in names), backend=backend, impl=impl))


def update(names: list[str] | None = None, root: Path | str = GOLDEN_DIR, *, impl: str | None = None,
           runner=None, out: Callable[[str], None] = print) -> list[Change]:
    """Regenerate ``names`` (default: every case; stale folders are removed then) and print the summary."""
    from cp_harness.cases.implementation import selected_impl_name

    impl = impl or (runner.impl if runner is not None else selected_impl_name())
    everything = names is None
    names = list(CASES) if names is None else names
    own = runner is None
    runner = runner or _runner(impl, "gloo", names)
    changes = []
    try:
        # Pipelined: the ranks run the next cases while this one is judged and written.
        for name, outputs in zip(names, runner.run_outputs_many([CASES[name] for name in names])):
            changes.append(regenerate(name, CASES[name], outputs, root, implementation=impl, backend=runner.config.backend))
    finally:
        if own:
            runner.close()
    if everything:
        changes += remove_stale(root)
    out(summarize(changes))
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_harness golden", description="golden files (docs/golden.md)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in (("check", "compare the current oracle and implementation with the golden files"),
                          ("update", "regenerate the golden files that changed (CPU, gloo) and print what changed"),
                          ("list", "list the canonical cases")):
        p = sub.add_parser(command, help=text)
        if command == "list":
            continue
        p.add_argument("-k", dest="pattern", default=None, help="only cases whose name contains this")
        p.add_argument("--dir", default=str(GOLDEN_DIR), help=f"golden folder (default {GOLDEN_DIR})")
        p.add_argument("--impl", default=None, help="module under test (default: $CP_IMPL or cp_impl)")
        if command == "check":
            p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
            p.add_argument("--storage-only", action="store_true", help="verify the files and the oracle; start no ranks")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, case in CASES.items():
            print(f"{name}: {canonical(case)}")
        return 0
    from cp_harness.cases.implementation import selected_impl_name

    impl = selected_impl_name(args.impl)
    names = _select(args.pattern)
    if args.command == "update":
        try:
            update(names if args.pattern else None, args.dir, impl=impl)
        except GoldenError as exc:
            print(f"golden update failed: {exc}", file=sys.stderr)
            return 1
        return 0
    failures = 0
    stale = stale_folders(args.dir)
    if stale and not args.pattern:
        print(f"FAIL stale golden folders (not in cp_harness.golden.CASES): {', '.join(stale)}; regenerate with: {REGENERATE}")
    runner = None if args.storage_only else _runner(impl, args.backend, names)
    # Pipelined: the ranks run the next cases while this one is checked.
    runs = None if runner is None else runner.run_outputs_many([CASES[name] for name in names])
    try:
        for name in names:
            outputs = None if runs is None else next(runs)
            try:
                golden = load(name, args.dir)
                verdict = verify(golden, outputs, implementation=impl, backend=args.backend)
            except GoldenError as exc:
                print(f"FAIL {name}: {exc}")
                failures += 1
                continue
            if verdict.ok:
                same = {True: ", bit-identical", False: ", within budget (not bit-identical)", None: ""}[verdict.bit_identical]
                print(f"ok   {name} ({len(verdict.comparisons)} comparisons{same})")
            else:
                print(f"FAIL {verdict.format()}")
                failures += 1
    finally:
        if runner is not None:
            runner.close()
    print(f"{len(names) - failures} of {len(names)} golden cases match")
    return 1 if failures or (stale and not args.pattern) else 0
