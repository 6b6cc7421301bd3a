"""Regenerating golden files: only what changed is rewritten, and the summary says by how much."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from cp_harness import checks
from cp_harness.golden.contents import (
    ARRAY_FILES,
    CASES,
    GOLDEN_DIR,
    IMPL_FILE,
    MANIFEST,
    ORACLE_FILE,
    GoldenError,
    _jsonable,
    impl_arrays,
    oracle_arrays,
)
from cp_harness.golden.storage import Golden, build_files, encode_npz, load
from cp_harness.judging.compare import compare_ulp
from cp_harness.judging.render import report_text


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
            c = compare_ulp(name, a, e, budget_ulp=math.inf, ulp_dtype=ulp_dtype)
            changed = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
            lines.append(
                f"{kind} {name}: {changed} of {a.size} elements changed, max |change| {c.max_abs:.3g}, "
                f"max {c.max_ulp:.3g} ULP"
            )
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


def regenerate(
    name: str,
    case: dict,
    outputs: list,
    root: Path | str = GOLDEN_DIR,
    *,
    implementation: str = "cp_impl",
    backend: str = "gloo",
) -> Change:
    """Write ``root/name`` from the current oracle and the ranks' ``outputs``, touching only what changed.

    Refuses (``GoldenError``) when the check itself rejects the outputs (a
    failing implementation is never pinned) or when the outputs did not come
    from a CPU (gloo) pool: goldens are CPU-made.
    """
    if backend != "gloo":
        raise GoldenError(f"golden files are made on CPU (gloo); refusing to regenerate {name!r} from a {backend} run")
    report = checks.evaluate(case, outputs)
    if not report.ok:
        raise GoldenError(
            f"refusing to pin {name!r}: the check rejects the implementation {implementation!r}:\n{report_text(report)}"
        )
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
        same = (
            encode_npz(oracle) == encode_npz(old.oracle)
            and encode_npz(impl) == encode_npz(old.impl)
            and rules == old.rules
            and _jsonable(info) == old.manifest["rank_info"]
        )
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


def _runner(impl: str, backend: str, names: list[str]):
    from cp_harness.ranks.pool import PoolConfig
    from cp_harness.runner import CaseRunner

    return CaseRunner(
        PoolConfig(world_size=max(int(CASES[n]["world_size"]) for n in names), backend=backend, impl=impl)
    )


def update(
    names: list[str] | None = None,
    root: Path | str = GOLDEN_DIR,
    *,
    impl: str | None = None,
    runner=None,
    out: Callable[[str], None] = print,
) -> list[Change]:
    """Regenerate ``names`` (default: every case; stale folders are removed then) and print the summary."""
    from cp_harness.cases.implementation import DEFAULT_IMPL

    impl = impl or (runner.impl if runner is not None else DEFAULT_IMPL)
    everything = names is None
    names = list(CASES) if names is None else names
    own = runner is None
    runner = runner or _runner(impl, "gloo", names)
    changes = []
    try:
        # Pipelined: the ranks run the next cases while this one is judged and written.
        for name, outputs in zip(names, runner.run_outputs_many([CASES[name] for name in names])):
            changes.append(
                regenerate(name, CASES[name], outputs, root, implementation=impl, backend=runner.config.backend)
            )
    finally:
        if own:
            runner.close()
    if everything:
        changes += remove_stale(root)
    out(summarize(changes))
    return changes
