"""Coverage claims are true: a row that says it covers a documented function must call it.

- ``cp_harness.instruments.coverage`` records calls through an implementation's documented
  functions and a sharder's verbs, and not the implementation's internal calls;
- a verify row whose cases never call a function it claims fails, naming it.
"""

from __future__ import annotations

import io

from cp_harness.instruments import coverage
from cp_harness.checks.transport import gather_cases
from cp_harness.cases.implementation import load_impl
from cp_harness.cases.profiles import CaseSpace
from cp_harness.checks import VerifyRow
from cp_harness.verify import Progress, Row, run_row


def test_instrumented_calls_are_recorded_and_internal_ones_are_not():
    import torch

    impl = coverage.instrument(load_impl("cp_impl"))
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "seq_lens": torch.tensor([[2, 1]]),
             "seq_lens_padded": torch.tensor([[2, 2]])}
    with coverage.recording() as called:
        returned = impl.inkling2.prepare_cp_inputs(batch)  # normalises the pack with internal code
    assert called == {"inkling2.prepare_cp_inputs"}
    sharder = coverage.RecordingSharder(returned["cp_sharder"])
    with coverage.recording() as called:
        sharder.shard(batch)
        sharder.shard_token_tensor(torch.zeros(1, 4), fill=0)
        assert sharder.shard_layout.padded_seq_len == 4  # everything else is the sharder's own
    assert called == {"sharder.shard", "sharder.shard_token_tensor"}
    coverage.note("outside")  # no recording active: nothing to record into, nothing raised


def test_claims_with_wildcards():
    assert coverage.covered(["inkling2.*", "sharder.shard"], {"inkling2.gather_sequence"}) == ["sharder.shard"]
    assert coverage.covered(["mistral_large4.*"], {"inkling2.gather_sequence"}) == ["mistral_large4.*"]


def test_a_row_that_never_calls_a_claimed_function_fails(cp_runner, tmp_path):
    row = Row(VerifyRow("gathers claiming unpack_row_layout",
                        lambda space: gather_cases(space).filter(lambda c: c["check"] == "gather_sequence"),
                        ("inkling2.gather_sequence", "inkling2.unpack_row_layout"), id="false-claim"))
    run_row(row, cp_runner, CaseSpace(world_sizes=(1, 2)), 3, 0, Progress(3, stream=io.StringIO()), "gloo",
            str(tmp_path), 3.0)
    assert row.tally.passed == row.tally.examples == 3  # every case passed its comparisons ...
    assert not row.ok and "inkling2.unpack_row_layout" in row.failure.text  # ... and the false claim fails the row
    assert "inkling2.gather_sequence" in row.tally.called and "inkling2.unpack_row_layout" not in row.tally.called


def _gather_row(claims: tuple[str, ...], explicit: tuple[dict, ...]) -> Row:
    return Row(VerifyRow("gathers with explicit cases", lambda space: gather_cases(space).filter(
        lambda c: c["check"] == "gather_sequence"), claims, explicit=explicit, id="explicit-claims"))


TOKENS_N3 = {"check": "gather_tokens", "world_size": 3, "seed": 5, "dtype": "float64", "shape": [2, 3],
             "differentiable": True}


def test_a_claim_whose_cases_need_more_ranks_than_the_run_is_said_not_reached_and_fails_nothing(cp_runner, tmp_path):
    """The verdict does not depend on the budget: the claim's own case cannot run on 2 ranks, so the row says the
    function was not reached instead of failing for what 3 drawn gathers of another function happened to call."""
    row = _gather_row(("inkling2.gather_sequence", "mistral_large4.gather_tokens"), (TOKENS_N3,))
    run_row(row, cp_runner, CaseSpace(world_sizes=(1, 2)), 3, 0, Progress(3, stream=io.StringIO()), "gloo",
            str(tmp_path), 3.0)
    assert row.ok and "mistral_large4.gather_tokens" not in row.tally.called, row.failure
    (what, why), = row.tally.not_judged.items()
    assert "mistral_large4.gather_tokens" in what and "not reached" in why and "2" in why


def test_a_claim_whose_case_ran_is_judged_on_what_it_called(cp_runner, tmp_path):
    """With 3 ranks the same case runs first and reaches the claim; a case built for a claim that ran and did not
    reach it fails the row (here: a layout case of an unpacked batch, which never needs unpack_row_layout)."""
    row = _gather_row(("inkling2.gather_sequence", "mistral_large4.gather_tokens"), (TOKENS_N3,))
    run_row(row, cp_runner, CaseSpace(world_sizes=(1, 3)), 1, 0, Progress(2, stream=io.StringIO()), "gloo",
            str(tmp_path), 3.0)
    assert row.ok and not row.tally.not_judged and "mistral_large4.gather_tokens" in row.tally.called
    unpacked = {"check": "inkling2_layout", "world_size": 2, "seed": 3, "model": "inkling2", "num_chunks": 1,
                "batch": {"format": "bshd", "seq_len": 5, "rows": [[0, 5]]}}
    row = _gather_row(("inkling2.gather_sequence", "inkling2.unpack_row_layout"), (unpacked,))
    run_row(row, cp_runner, CaseSpace(world_sizes=(1, 2)), 1, 0, Progress(2, stream=io.StringIO()), "gloo",
            str(tmp_path), 3.0)
    assert not row.ok and "inkling2.unpack_row_layout" in row.failure.text and not row.tally.not_judged


SPACES = (CaseSpace(world_sizes=(1,)), CaseSpace(world_sizes=(1, 2)), CaseSpace(world_sizes=(1, 2, 3, 4)))


def test_every_claim_of_every_row_has_a_case_built_for_it_in_any_space():
    """What makes a verdict budget-independent: each claim of each row is backed, in a pool of 1, 2 and 4 ranks, by
    an explicit case that fits or by a case of the row's own strategy built to reach it (drawn, none run here)."""
    from cp_harness.cases.meshes import ranks_needed
    from cp_harness.checks import load_checks
    from cp_harness.verify.search import _built_for, cases_built_for

    rows = [row for check in load_checks().values() for row in check.rows if row.functions and not row.needs_model]
    assert len(rows) >= 15
    unbacked = []
    for space in SPACES:
        for row in rows:
            fitting = [case for case in row.explicit if ranks_needed(case) <= space.pool_ranks]
            backed = set().union(*(_built_for(case, list(row.functions)) for case in fitting)) if fitting else set()
            rest = [f for f in row.functions if f not in backed]
            drawn = cases_built_for(rest, row.cases(space), space, 0)
            assert all(ranks_needed(case) <= space.pool_ranks for case in drawn.values())
            unbacked += [(row.id, space.world_sizes, f) for f in rest if f not in drawn]
    assert not unbacked, unbacked


def _mesh_row(row_id: str) -> Row:
    from cp_harness.checks.meshes import MESH_IDENTITY

    return Row(next(r for r in MESH_IDENTITY.rows if r.id == row_id))


def test_the_meshes_rows_reach_every_claim_with_one_example_at_cp_1(cp_runner, tmp_path):
    """Regression of issue 36's false alarm (real_clients --examples 5, adapter shard_batch_identity at CP 1: "the
    row claims mistral_large4.gather_tokens, but none of its 5 cases called it"): the explicit cases need 4 ranks,
    the one drawn case reaches one source's function; the others are reached by cases drawn for them, no note."""
    for row_id, claims in (("meshes.functions", 4), ("meshes.models", 5)):
        row = _mesh_row(row_id)
        run_row(row, cp_runner, CaseSpace(world_sizes=(1,)), 1, 0, Progress(1, stream=io.StringIO()), "gloo",
                str(tmp_path), 3.0)
        assert row.ok, (row_id, row.failure)
        assert len(row.spec.functions) == claims and not coverage.covered(row.spec.functions, row.tally.called)
        assert not row.tally.not_judged, row.tally.not_judged
        assert 1 < row.tally.examples <= 1 + claims  # the drawn one, then at most one per claim it did not reach


def test_the_layout_rows_reach_every_claim_with_one_example_at_cp_1(cp_runner, tmp_path):
    """Regression of the same kind, found with ``real_clients --examples 1`` (adapter shard_batch_identity, and
    ``cp_impl`` alike): "the row claims mistral_large4.prepare_packed_cp_inputs, but none of its 2 cases called it".
    The layout checks named every function as reached by any case, so the case drawn for the packed hook was the
    first draw, a BSHD or THD batch through ``prepare_cp_inputs``; their ``reaches`` now say which hook a case calls
    (``direct_packed``) and that only a THD batch calls ``unpack_row_layout`` on its own."""
    from cp_harness.checks.layout import INKLING2_LAYOUT, MISTRAL_LARGE4_LAYOUT

    for check in (INKLING2_LAYOUT, MISTRAL_LARGE4_LAYOUT):
        for spec in (r for r in check.rows if r.functions):
            row = Row(spec)
            run_row(row, cp_runner, CaseSpace(world_sizes=(1,)), 1, 0, Progress(1, stream=io.StringIO()), "gloo",
                    str(tmp_path), 3.0)
            assert row.ok, (spec.name, row.failure)
            assert not coverage.covered(spec.functions, row.tally.called), (spec.name, row.tally.called)
            assert not row.tally.not_judged, row.tally.not_judged
