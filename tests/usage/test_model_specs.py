"""A rank that runs the cases of several model specs behaves as a process that runs one: what ``torch.compile``
compiled for the last spec is forgotten when the next spec's case starts (``model_specs.one_spec_at_a_time``).

The false alarm this keeps: with every spec of the gate on shared pools, functions the framework compiles with
``fullgraph=True`` and that several specs share reached dynamo's recompile limit, and glm5_next's and
llama3_flex_ptrr's next cases raised ``FailOnRecompileLimitHit`` (a new finding that one process per spec never
showed). No ranks: the same budget in one process, on a function compiled with the eager backend.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from cp_harness.usage import model_specs


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(model_specs, "_COMPILED_FOR", [])
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _shapes_compiled_by_spec(specs: list[str], shapes_each: int, limit: int) -> None:
    """``shapes_each`` input shapes under each of ``specs`` in turn, none seen before, through one ``fullgraph``
    function compiled without dynamic shapes (every new shape is a recompile), at ``recompile_limit`` = ``limit``."""
    double = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=limit, automatic_dynamic_shapes=False):
        for i, spec in enumerate(specs):
            model_specs.one_spec_at_a_time(spec)
            for n in range(i * shapes_each + 1, (i + 1) * shapes_each + 1):
                assert torch.equal(double(torch.ones(n)), torch.full((n,), 2.0))


def test_several_specs_on_one_rank_each_get_the_recompile_budget_of_a_process_of_their_own(fresh):
    _shapes_compiled_by_spec(["spec_a", "spec_b", "spec_a"], shapes_each=3, limit=3)


def test_without_forgetting_the_specs_together_would_hit_the_limit(fresh, monkeypatch):
    monkeypatch.setattr(torch.compiler, "reset", lambda: None)  # what the shared pools did before
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        _shapes_compiled_by_spec(["spec_a", "spec_b"], shapes_each=3, limit=3)


def test_cases_of_one_spec_keep_what_was_compiled(fresh, monkeypatch):
    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    for spec in ["a", "a", "b", "b", "a"]:
        model_specs.one_spec_at_a_time(spec)
    assert len(resets) == 2
