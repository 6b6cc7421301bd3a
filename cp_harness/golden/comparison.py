"""Comparing current results with a golden case: the oracle against the golden oracle, the implementation
against the golden implementation (within the check's budgets where it is arithmetic, bit for bit otherwise),
and the check's own verdict on both."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cp_harness import checks
from cp_harness.cases.descriptions import padded_length
from cp_harness.golden.contents import (
    REGENERATE,
    GoldenError,
    combine_rule,
    impl_arrays,
    numerics_platform,
    oracle_arrays,
)
from cp_harness.golden.storage import Golden, encode_npz
from cp_harness.judging.compare import Comparison, TokenGrid, compare_exact, compare_ulp
from cp_harness.judging.policy import STRICT
from cp_harness.judging.render import golden_text, report_text


def _grid(case: dict, kind: str, name: str, arr: np.ndarray) -> TokenGrid | None:
    """The shard grid of a token-aligned array (names the owning rank of a mismatch), else ``None``."""
    n = int(case["world_size"])
    if kind == "impl":
        token = combine_rule(case, name) == {"combine": "concat", "axis": 1}
    else:
        golden = checks.check_of(case).golden
        assert golden is not None  # golden arrays are compared only for checks with golden files
        token = name in golden.token_arrays
    if not token or arr.ndim < 2:
        return None
    if "batch" in case:
        S_pad = padded_length(int(case["batch"]["seq_len"]), n)
        return TokenGrid(S_pad // n, n)
    return TokenGrid(arr.shape[1] // n, n) if arr.shape[1] % n == 0 else None


def _impl_mask(case: dict, name: str, arr: np.ndarray, oracle: dict[str, np.ndarray]) -> np.ndarray | None:
    """What the contract specifies of an implementation array (``None``: all of it)."""
    golden = checks.check_of(case).golden
    assert golden is not None  # golden arrays are compared only for checks with golden files
    specified = golden.impl_mask
    return None if specified is None else specified(case, name, arr, oracle)


def _mode(case: dict, arr: np.ndarray) -> str:
    if not checks.check_of(case).arithmetic or np.asarray(arr).dtype.kind not in "fc":
        return "exact"
    return "ulp"


def compare_arrays(
    case: dict,
    kind: str,
    actual: dict[str, np.ndarray],
    expected: dict[str, np.ndarray],
    *,
    oracle: dict[str, np.ndarray] | None = None,
) -> tuple[list[Comparison], list[str]]:
    """Compare current arrays with golden ones: ``(comparisons, problems)``.

    ``kind``: ``"oracle"`` (float64 references; arithmetic within the float64
    budget) or ``"impl"`` (the case's dtype and budget; layout arrays only
    where the contract specifies them, using ``oracle["keep"]``).
    """
    comparisons: list[Comparison] = []
    problems: list[str] = []
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing:
        problems.append(f"{kind}: arrays {missing} are in the golden file but were not produced now")
    if extra:
        problems.append(f"{kind}: arrays {extra} were produced now but are not in the golden file")
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
            comparisons.append(compare_exact(label, a, e, mask=mask, grid=_grid(case, kind, name, e)))
        else:
            budget = STRICT.budget(checks.check_of(case), ulp_dtype)
            comparisons.append(
                compare_ulp(
                    label,
                    a,
                    e,
                    budget_ulp=budget.ulp,
                    floor_fraction=budget.floor_fraction,
                    mask=mask,
                    grid=_grid(case, kind, name, e),
                    ulp_dtype=ulp_dtype,
                )
            )
    return comparisons, problems


@dataclasses.dataclass
class Verdict:
    """The outcome of comparing one golden case with the current oracle and implementation."""

    name: str
    case: dict
    path: str = ""
    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    bit_identical: bool | None = None  # would regenerating change nothing (same bytes)?

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.comparisons)

    def format(self) -> str:
        return golden_text(self, REGENERATE)


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
        verdict.notes.append(
            f"the golden files were made with PyTorch {recorded}; this run uses PyTorch {torch.__version__}"
        )
    elif golden.manifest["numerics_platform"] != numerics_platform():
        verdict.notes.append(
            f"the golden files were made on {golden.manifest['numerics_platform']}; this run is on "
            f"{numerics_platform()}: float results may differ in their last bits (compared within budgets)"
        )
    made_by = golden.manifest["produced_by"]
    if backend != made_by.get("backend") or implementation != made_by.get("implementation"):
        verdict.notes.append(
            f"the golden implementation results come from {made_by.get('implementation')!r} on "
            f"{made_by.get('backend')}; this run judges {implementation!r} on {backend}"
        )
    oracle_now = oracle_arrays(case)
    comps, probs = compare_arrays(case, "oracle", oracle_now, golden.oracle)
    verdict.comparisons += comps
    verdict.problems += probs
    expected = checks.expect(case)  # the oracle once, for both verdicts (it is only read)
    golden_report = checks.evaluate(case, golden.rank_outputs(), expected)
    if not golden_report.ok:
        verdict.problems.append(
            "the check rejects the golden implementation results against the oracle:\n" + report_text(golden_report)
        )
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
            verdict.problems.append(
                "the check rejects the current implementation against the oracle:\n" + report_text(report)
            )
        verdict.bit_identical = (
            encode_npz(oracle_now) == encode_npz(golden.oracle)
            and encode_npz(impl_now) == encode_npz(golden.impl)
            and rules == golden.rules
            and info == golden.manifest["rank_info"]
        )
    return verdict
