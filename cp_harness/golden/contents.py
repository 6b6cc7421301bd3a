"""What a golden case holds: the canonical cases (each check's own), the oracle's arrays (from the check's
own ``expect``), the ranks' arrays combined in rank order, and the platform that decides their last bits.

Shapes: token-aligned implementation arrays are the ranks' local ``[batch, local_len, ...]`` tensors
concatenated along the check's rank axis (global order); everything else is stacked per rank ``[N, ...]``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from cp_harness import checks
from cp_harness.cases.descriptions import canonical

FORMAT_VERSION = 2  # 2: manifests record the numerics platform (float results differ in their last bits across CPUs)
GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden"  # the CLI's --dir / $CP_HARNESS_GOLDEN_DIR point elsewhere
MANIFEST = "manifest.json"
ORACLE_FILE = "oracle.npz"
IMPL_FILE = "impl.npz"
ARRAY_FILES = (ORACLE_FILE, IMPL_FILE)
REGENERATE = "./scripts/test tests/golden/test_golden.py --update-golden  (or: python -m cp_harness golden update)"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def _canonical_cases() -> dict[str, dict]:
    """Every check's golden cases, by folder name (sorted). Each is an ordinary case description
    (``cp_harness.cases.descriptions``): it can be pasted into ``python -m cp_harness run-case`` or used as
    a Hypothesis ``@example``, and vice versa."""
    found: dict[str, dict] = {}
    for check in checks.load_checks().values():
        for name, case in check.golden.cases.items() if check.golden is not None else ():
            if name in found:
                raise ValueError(f"golden case {name!r} is listed by two checks")
            found[name] = case
    return dict(sorted(found.items()))


CASES: dict[str, dict] = _canonical_cases()


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
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": f"{vendor} {model}".strip(),
    }


class GoldenError(Exception):
    """A golden file is missing, damaged, edited, refused (would need pickle) or does not match its manifest."""


def _fail(path: Path | str, problem: str) -> GoldenError:
    return GoldenError(f"golden file {path}: {problem}\nregenerate with: {REGENERATE}")


def _np(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return checks.to_numpy(value)
    return np.asarray(value)


def _golden_of(case: dict) -> checks.GoldenContents:
    check = checks.check_of(case)
    if check.golden is None:
        raise GoldenError(f"check {check.name!r} says nothing of golden files; give it GoldenContents")
    return check.golden


def oracle_arrays(case: dict) -> dict[str, np.ndarray]:
    """The oracle's reference arrays for ``case``: what its check's own ``expect`` computes, named by the check.

    Computed with one torch thread so that the float64 sums, and the files, are the same on every machine
    whatever its core count."""
    contents = _golden_of(case)
    expected = checks.expect(case)
    return {name: _np(value) for name, value in contents.oracle_arrays(case, expected).items()}


def combine_rule(case: dict, tensor: str) -> dict:
    """How the ranks' local ``tensor`` is combined into one golden array (and split back): each rank's ``[L]``
    index map (``token_indices``) and sharded ``arange(S)`` (``token_marker``) on axis 0, the rest as the check says."""
    axis = 0 if tensor in ("token_indices", "token_marker") else _golden_of(case).rank_axis(case, tensor)
    return {"combine": "stack"} if axis is None else {"combine": "concat", "axis": axis}


def impl_arrays(case: dict, outputs: list) -> tuple[dict[str, np.ndarray], dict[str, dict], list[dict]]:
    """``(arrays, rules, rank_info)`` from the ranks' outputs of ``case``, combined in rank order."""
    failed = [o for o in outputs if not o.ok]
    if failed:
        o = failed[0]
        raise GoldenError(f"case {canonical(case)}: rank {o.rank} raised {o.error_type}: {o.message}")
    names = sorted(outputs[0].tensors)
    for o in outputs:
        if sorted(o.tensors) != names:
            raise GoldenError(
                f"case {canonical(case)}: rank {o.rank} returned tensors {sorted(o.tensors)}, rank 0 {names}"
            )
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
    return [
        RankOutput(rank=r, ok=True, info=copy.deepcopy(rank_info[r]), tensors=per_rank[r], comm=[], seconds=0.0)
        for r in range(n)
    ]


def _jsonable(value):
    return json.loads(json.dumps(value, sort_keys=True))
