"""Checks: one module per check, and each check owns everything about itself.

A ``Check`` is registered under one name by its own module, and every other
unit asks it instead of switching on that name (a check's name appears as a
string literal only in its module): what runs on the ranks (``rank``), the
oracle half (``expect``) and the comparison (``evaluate``), whether it is
exact data movement or arithmetic, its ULP budgets per dtype, its one-rank
baseline rule, its communication minimum, what its golden files hold, the
documented functions it claims to cover, its verify rows and named explicit
examples. A new check is a new file.

Modules (every module of this package not starting with ``_`` is a check
module, loaded with ``pkgutil``):

* ``transport`` -- ``gather_sequence``, ``gather_tokens``, ``convolution_history``
  (bit-exact data movement, forward and backward).
* ``sharder_roundtrip`` -- ``sharder_roundtrip``: the sharder's verbs, shard then gather, judged the same way.
* ``layout`` -- ``inkling2_layout``, ``mistral_large4_layout``: the prepared
  batch and the layout the sharder reports.
* ``sharder_verbs`` -- the sharder's verbs on tensors of rank 2-5, ``seq_dim`` 1 and 2, every payload
  dtype, ``trim`` and ``fill``, under every ``ShardLayout`` field (repositioned and THD layouts included).
* ``loss_mask`` -- ``loss_mask_layout``: a loss mask given to the sharder is
  sharded at the reported index map with its padding value.
* ``positions`` -- ``validate_document_positions``.
* ``loss`` -- ``shifted_cp_loss`` against the oracle's shifted cross-entropy.
* ``models`` -- ``model``: both miniature models end to end, forward and backward.
* ``real_model`` -- a real framework model through a model spec: its own CP path against the same model on
  one device, within a bound scaled by a measured reference spread; padding sensitivity told apart.
* ``cp_attention`` -- a framework's own CP attention function (an *attention subject*: the EAGLE-3 ring, zig-zag ring
  and Ulysses attention) on every rank against float64 attention on one device: output, dQ and every key / value
  block's gradient, with the excess judge against the same subject on one rank.
* ``training_step`` -- a real model's training step as the framework's recipe runs it on ``dp_shard x cp`` (FSDP2,
  the recipe's loss scaling, the clip-grad norm) against one device on the whole global batch (``--step training``).
* ``malformed`` -- ``malformed``: every entry of the malformed-input catalogue raises a clear error on every rank.
* ``meshes`` -- ``mesh_identity`` (the pool hands each rank the right ``world_mesh["cp"]``) and the verify rows
  that run the other checks' cases on world meshes of two and three dimensions (``cp_harness.cases.meshes``).
* ``pool_selftest``, ``meter_selftest``, ``bench_memory`` -- cases that test the
  harness itself (faults, the communication meter, per-rank memory).
* ``_token_layout`` -- shared by the checks: rank outputs in global order, the
  reported layout judged against the contract.
* ``_readiness`` -- shared by ``real_model`` and ``training_step``: every rank agrees it could build the case before
  any collective; a failure is every rank's answer (a refusal naming the rank), not a raise that restarts the pool.
* ``_verb_contract`` -- the contract of the sharder's verbs as ``sharder_verbs``' oracle applies it (the layout
  fields a rank reported, a caller's tensor into the padded stream and back).

Flow: ``run_on_rank(case, ctx)`` on every rank; ``expect(case)`` (the oracle,
from the case alone, while the ranks run) and ``evaluate(case, outputs,
expected, policy=...)`` in the test process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from cp_harness.cases import meshes
from cp_harness.checks._token_layout import NotShardedLikeTokens
from cp_harness.instruments import coverage
from cp_harness.judging.budgets import Budget
from cp_harness.judging.policy import STRICT, JudgingPolicy
from cp_harness.judging.verdicts import CaseReport, ProblemKind


@dataclasses.dataclass
class RankContext:
    """What a rank knows while it runs a case: its CP rank (``rank``: its place in its CP group, not its global
    rank), the CP size, the CP mesh (``world_mesh["cp"]`` for a case with a ``mesh_layout``; ``None`` when the
    case asks for no mesh), its device, the implementation under test, its global rank and its CP group's index
    (``cp_harness.cases.meshes``)."""

    rank: int
    cp_size: int
    mesh: Any
    device: torch.device
    backend: str
    impl: Any
    global_rank: int | None = None
    group: int | None = None

    def mesh_for(self, case: dict):
        """The mesh argument the case wants the implementation to receive."""
        if case.get("mesh", "mesh") == "none":
            if self.cp_size != 1:
                raise ValueError(
                    f"case asks for mesh='none' with world_size={self.cp_size}; only world_size=1 can run without a mesh"
                )
            return None
        return self.mesh


def _no_axis(case: dict, tensor: str) -> int | None:
    return None


@dataclasses.dataclass(frozen=True)
class GoldenContents:
    """What a check's golden files hold (``cp_harness.golden``).

    ``cases``: folder name -> case description. ``oracle_arrays(case, expected)``: the named reference arrays,
    taken from what the check's own ``expect`` returned (one oracle for properties and golden files alike).
    ``token_arrays``: the oracle arrays laid out ``[batch, global sequence, ...]``. ``rank_axis(case, tensor)``:
    the axis along which the ranks' local ``tensor`` is concatenated into one array (``None``: stacked per rank;
    index maps are always concatenated on axis 0). ``impl_mask(case, name, array, oracle)``: what the contract
    specifies of an implementation array (``None``: all of it).
    """

    cases: Mapping[str, dict]
    oracle_arrays: Callable[[dict, Any], dict[str, Any]]  # tensors or arrays; golden stores them as arrays
    token_arrays: frozenset[str] = frozenset()
    rank_axis: Callable[[dict, str], int | None] = _no_axis
    impl_mask: Callable[..., np.ndarray | None] | None = None


@dataclasses.dataclass(frozen=True)
class VerifyRow:
    """One row of ``verify``'s table: ``label`` what the table prints, ``id`` what reports and tools key it by,
    ``cases(space)`` its Hypothesis strategy, ``functions`` the documented functions it claims (checked by
    coverage), ``dtypes`` the payload dtypes it can draw (empty: a layout row), ``explicit`` cases run before
    the drawn ones, ``position`` where it stands in the table."""

    label: str
    cases: Callable[[Any], Any]
    functions: tuple[str, ...]
    dtypes: tuple[str, ...] = ()
    explicit: tuple[dict, ...] = ()
    position: float = 0
    needs_model: bool = False  # a real-model row: runs only when a model spec is given (``--model``)
    step: str = "forward-backward"  # a real-model row's ``--step`` mode: it runs only when that mode is asked for
    id: str = ""  # a stable identifier apart from the label (``register`` gives the check's name by default)
    # Why the row cannot run in a case space (``None``: it can), e.g. every model spec it would draw needs CUDA.
    skip: Callable[[Any], str | None] | None = None


@dataclasses.dataclass(frozen=True)
class Repro:
    """How a failing case of the check becomes a standalone script (``cp_harness.repro``; ``CaseRunner.export_repro``
    writes it).

    ``plan(request) -> repro.Plan``: the script of a failing case (``request``: the case, the implementation it
    ran, the judging policy, the report); the check says what each rank receives, which calls it makes and what
    they must return, a family of ``cp_harness.repro`` writes the script. ``replays``: documented function ->
    ``recorded(call: repro.RecordedCall) -> repro.calls.CallCase``, what that call must return given what it
    received in another check's run (the check's definition of it, for narrowing). ``narrow(case) -> [cases]``:
    the check runs whole models; its failure is narrowed to the first documented call recorded on the ranks that
    is wrong on its own (judged by the checks that ``replay`` it), else to the first of these cases of other
    checks that fails."""

    plan: Callable[[Any], Any] | None = None
    replays: Mapping[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)
    narrow: Callable[[dict], list[dict]] | None = None


def _same_case_on_one_rank(case: dict) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Check:
    """A check and everything it owns (see the package docstring).

    ``rank(case, ctx) -> (info, tensors)`` runs on every rank; ``expect(case)`` is the oracle work from the
    case alone (``None``: ``evaluate`` does it); ``evaluate(case, outputs, expected)`` judges (arithmetic
    checks also take the judging ``policy``). ``arithmetic``: compared within ``budgets`` (per dtype) and by
    the excess judge against ``one_rank_changes(case)`` (what the one-rank baseline changes besides
    ``world_size = 1``); otherwise bit for bit. ``comm_minimum(case)``: the least bytes ``[(sent, received)]``
    per rank the case's calls must move (``None``: no closed form).
    """

    name: str
    rank: Callable[[dict, RankContext], tuple[dict, dict[str, torch.Tensor]]]
    evaluate: Callable[..., CaseReport]
    expect: Callable[[dict], Any] | None = None
    functions: tuple[str, ...] = ()
    arithmetic: bool = False
    budgets: Mapping[str, Budget] = dataclasses.field(default_factory=dict)
    one_rank_changes: Callable[[dict], dict] = _same_case_on_one_rank
    comm_minimum: Callable[[dict], list[tuple[int, int]] | None] | None = None
    golden: GoldenContents | None = None
    rows: tuple[VerifyRow, ...] = ()
    examples: Mapping[str, dict] = dataclasses.field(default_factory=dict)
    # Share of the profile's examples that the gate suite's generic property (cp_harness/tests/
    # test_declared_checks.py) spends on each of the check's rows, its named examples included; 0 for the
    # checks that have a gate test module of their own.
    gate_share: float = 0.0
    # Its verdict depends on the precision policy (sums of low-precision contributions): ``evaluate`` takes
    # the policy, as arithmetic checks' do.
    precision_policy: bool = False
    repro: Repro | None = None  # how a failing case becomes a standalone script (None: it does not)
    # The documented functions one case is built to reach (None: ``functions``), for a check whose cases reach a
    # part of them by their keys (a model case: its model's functions); a row's claims are judged by it
    # (``cp_harness.verify.search``).
    reaches: Callable[[dict], tuple[str, ...]] | None = None

    def case(self, **keys) -> dict:
        """A case description of this check."""
        return {"check": self.name, **keys}

    def with_examples(self, where: Callable[[dict], bool] | None = None):
        """A decorator that adds the check's named examples (those ``where`` selects) to a Hypothesis test as
        explicit examples: the regressions live with the check, the gate tests name the check."""
        from hypothesis import example

        def decorate(test):
            for case in self.examples.values():
                if where is None or where(case):
                    test = example(case=case)(test)
            return test

        return decorate

    def least_communication(self, case: dict) -> list[tuple[int, int]] | None:
        """``[(sent, received)]`` per rank: the least bytes the case's calls must move (``None``: no closed form)."""
        return self.comm_minimum(case) if self.comm_minimum is not None else None

    def baseline_case(self, case: dict) -> dict | None:
        """The one-rank run an arithmetic multi-rank ``case`` is judged against (``None``: none)."""
        if not self.arithmetic or int(case.get("world_size", 1)) <= 1:
            return None
        base = {k: v for k, v in case.items() if k not in ("mesh", meshes.KEY)}  # one rank: no mesh at all
        base["world_size"] = 1
        base.update(self.one_rank_changes(case))
        return base


CHECKS: dict[str, Check] = {}
_loaded = False


def register(name: str, **owned) -> Check:
    """Register the check ``name`` (its module calls this once) and return it."""
    if name in CHECKS:
        raise ValueError(f"check {name!r} registered twice")
    rows = tuple(owned.get("rows", ()))
    if len(rows) == 1 and not rows[0].id:
        rows = (dataclasses.replace(rows[0], id=name),)
    missing = [r.label for r in rows if not r.id]
    if missing:
        raise ValueError(f"check {name!r} declares several rows: give each an id (rows without: {missing})")
    taken = {r.id for check in CHECKS.values() for r in check.rows}
    clash = [r.id for r in rows if r.id in taken] or (
        [r.id for r in rows] if len({r.id for r in rows}) < len(rows) else []
    )
    if clash:
        raise ValueError(f"check {name!r}: row id(s) {clash} are taken; give each row its own id")
    CHECKS[name] = Check(name, **{**owned, "rows": rows})
    return CHECKS[name]


def load_checks() -> dict[str, Check]:
    global _loaded
    if not _loaded:
        for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
            importlib.import_module(f"cp_harness.checks.{module}")
        _loaded = True
    return CHECKS


def get_check(name: str) -> Check:
    checks = load_checks()
    if name not in checks:
        raise KeyError(f"unknown check {name!r}; known: {sorted(checks)}")
    return checks[name]


def check_of(case: dict) -> Check:
    """The check a case description names."""
    return get_check(case["check"])


def to_numpy(value: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy of a tensor (bfloat16 widened to float32)."""
    value = value.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.cpu().numpy().copy()


def run_on_rank(case: dict, ctx: RankContext) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the rank half of ``case["check"]``; tensors come back as numpy arrays. With ``"record_calls": true``
    the documented calls it made are replayed on their own afterwards (``coverage.replay``): ``info`` lists them
    under ``recorded_calls``, their tensors travel as ``call{i}/...``. The kernel stand-ins the implementation
    module declares (``STANDINS``, e.g. an adapter whose framework code calls a device kernel) are entered around
    it on their device; those that computed are listed in ``info["standins"]`` (the report names them)."""
    from cp_harness import standins  # the registry (imported here: the checks package loads before it is needed)

    declared = tuple(getattr(getattr(ctx.impl, "module", None), "STANDINS", ()))
    with standins.entered(declared, ctx.device.type) as stood_in:
        if not case.get("record_calls"):
            info, tensors = check_of(case).rank(case, ctx)
        else:
            with coverage.capturing() as captured:
                info, tensors = check_of(case).rank(case, ctx)
            calls, replayed = coverage.replay(captured)
            info, tensors = {**info, "recorded_calls": calls}, {**tensors, **replayed}
    if stood_in.used():  # an implementation's declared stand-ins that computed in this case (reported)
        info = {**info, "standins": {**info.get("standins", {}), **stood_in.used()}}
    return info, {name: to_numpy(t) if isinstance(t, torch.Tensor) else np.asarray(t) for name, t in tensors.items()}


@contextlib.contextmanager
def one_intra_op_thread():
    """Run the oracle with one torch thread, as the ranks do: faster for tiny tensors, and the
    float64 reductions (hence golden files) then do not depend on the machine's core count."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def expect(case: dict) -> Any:
    """The oracle half of ``case``'s check, computed from the case alone (before or while the ranks run it).

    ``NOT_GIVEN`` for a check without an ``expect`` (its ``evaluate`` does all the work). Pass the result
    to ``evaluate(case, outputs, expected)``; it is read, never changed, so it may be reused.
    """
    check = check_of(case)
    if check.expect is None:
        return NOT_GIVEN
    with one_intra_op_thread():
        return check.expect(case)


def evaluate(case: dict, outputs: list, expected: Any = NOT_GIVEN, *, policy: JudgingPolicy = STRICT) -> CaseReport:
    """Judge the outputs of every rank for ``case`` (test-process side).

    ``expected``: what ``expect(case)`` returned, when the caller computed it
    already (while the ranks ran); computed here otherwise. The oracle runs
    with one intra-op thread (as the ranks do): case tensors are tiny, and on a
    loaded machine OpenMP threads waiting for each other made the evaluation
    10-100 times slower (``docs/benchmarks.md``). ``policy``: how arithmetic
    checks apply their budgets.
    """
    raised = [o for o in outputs if not o.ok]
    if raised:
        report = CaseReport(case=case)
        for o in raised:
            report.problem(
                f"rank {o.rank} raised {o.error_type}: {o.message}\n{o.traceback}",
                rank=o.rank,
                kind=ProblemKind.RANK_RAISED,
            )
    else:
        check = check_of(case)
        args = [case, outputs]
        with one_intra_op_thread():
            if check.expect is not None:
                args.append(check.expect(case) if expected is NOT_GIVEN else expected)
            takes_policy = check.arithmetic or check.precision_policy
            try:
                report = check.evaluate(*args, policy=policy) if takes_policy else check.evaluate(*args)
            except NotShardedLikeTokens as finding:
                report = CaseReport(case=case)
                report.problem(str(finding), kind=ProblemKind.NOT_SHARDED_LIKE_THE_TOKENS)
    for o in outputs:  # stand-ins the ranks computed with (a spec's, an implementation's ``STANDINS``)
        report.standins.update(o.info.get("standins", {}) if o.ok else {})
    report.comm = [{"rank": o.rank, "calls": o.comm} for o in outputs]
    report.called = set().union(*(o.called for o in outputs)) if outputs else set()
    return report
