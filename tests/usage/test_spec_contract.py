"""``cp_harness.usage.spec_contract``: the model spec contract checked when a spec loads; no framework, no pool."""

from __future__ import annotations

import types

import pytest
import torch

from cp_harness.usage.spec_contract import ModelSpec, SpecError, check_spec


def _spec(**changes) -> types.ModuleType:
    module = types.ModuleType("a_spec")
    module.NAME, module.DTYPES = "tiny", (torch.float32,)
    module.build = lambda dtype=torch.float32, seed=0, **overrides: None
    module.shard = lambda model, mesh, batch, padding_token_id=0: None
    module.forward = lambda model, local_batch: None
    module.gather_logits = lambda sharder, local_logits: None
    module.loss = lambda logits, labels, num_label_tokens: None
    module.num_label_tokens = lambda batch: 0
    module.valid_positions = lambda batch: None
    module.make_batch = lambda kind, seq_len, **keys: {}
    for key, value in changes.items():
        if value is None:
            delattr(module, key)
        else:
            setattr(module, key, value)
    return module


def test_a_complete_spec_passes_and_its_declarations_get_defaults():
    module = _spec(WORLD_SIZES=(1, 2, 4), COVERS={"pkg.cp.f": "the halo"}, FORWARD_ONLY_ON={"cpu": "no backward"})
    assert isinstance(module, ModelSpec)
    traits = check_spec("a_spec", module)
    assert traits.world_sizes == (1, 2, 4) and traits.batch_kinds == ("plain", "right_padded", "packed")
    assert traits.forward_only("cpu") == "no backward" and traits.forward_only("cuda") is None
    assert traits.covers == {"pkg.cp.f": "the halo"} and traits.dtypes == ("float32",) and not traits.unmet()


@pytest.mark.parametrize("changes,message", [
    ({"loss": None}, "loss: missing (a function taking 3 positional argument(s))"),
    ({"forward": lambda model: None}, "forward: takes 1..1 positional argument(s); the contract calls it with 2"),
    ({"build": 3}, "build: int, not a function"),
    ({"NAME": None}, "NAME: missing"),
    ({"DTYPES": (torch.float64,)}, "DTYPES: give a non-empty tuple of torch.float32 / torch.bfloat16"),
    ({"WORLD_SIZES": [2, 3]}, "WORLD_SIZES: [2, 3]; give a tuple of positive CP sizes"),
    ({"BATCH_KINDS": ("packed", "ragged")}, "BATCH_KINDS: ('packed', 'ragged'); give a tuple among"),
    ({"COVERS": ["pkg.cp.f"]}, "COVERS: list; give a dict of str -> non-empty str"),
    ({"REQUIRES": {"cuda": ""}}, "REQUIRES: dict; give a dict of str -> non-empty str"),
])
def test_each_broken_field_is_named_with_what_it_should_be(changes, message):
    with pytest.raises(SpecError) as raised:
        check_spec("a_spec", _spec(**changes))
    assert message in str(raised.value) and "docs/extending.md" in str(raised.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(SpecError) as raised:
        check_spec("a_spec", _spec(loss=None, make_batch=None, WORLD_SIZES=(0,)))
    text = str(raised.value)
    assert "loss: missing" in text and "make_batch: missing" in text and "WORLD_SIZES" in text


def test_requirements_name_what_is_missing_here():
    traits = check_spec("a_spec", _spec(REQUIRES={"no_such_module_cp_harness": "GPU kernels", "torch": "always there"}))
    assert traits.unmet() == {"no_such_module_cp_harness": "GPU kernels"}


def test_a_declared_stand_in_meets_its_requirement_where_it_is_unmet():
    """``STANDINS``: a stand-in that meets ``cuda`` makes a spec whose only ``cuda`` need is that kernel runnable
    here (without CUDA), and says so; another unmet requirement still skips it; an unknown name is refused."""
    needs_cuda = {"cuda": "the ring's CUDA kernel"}
    plain = check_spec("a_spec", _spec(REQUIRES=needs_cuda))
    with_standin = check_spec("a_spec", _spec(REQUIRES=needs_cuda, STANDINS=("ring_sdpa_cpu",)))
    assert with_standin.standins == ("ring_sdpa_cpu",) and plain.standins == ()
    if torch.cuda.is_available():  # the requirement is met: the real kernel runs, nothing stands in
        assert not plain.unmet() and not with_standin.unmet() and with_standin.stood_in() == {}
    else:
        assert plain.unmet() == needs_cuda and with_standin.unmet() == {}
        assert with_standin.stood_in() == {"cuda": "CPU, stand-in: ring SDPA per-step kernel = "
                                                   "aten._scaled_dot_product_flash_attention_for_cpu"}
    also = check_spec("a_spec", _spec(REQUIRES={**needs_cuda, "no_such_module_cp_harness": "fused kernels"},
                                      STANDINS=("ring_sdpa_cpu",)))
    assert "no_such_module_cp_harness" in also.unmet()
    with pytest.raises(SpecError, match=r"STANDINS: \('no_such_standin',\); give a tuple of registered stand-in"):
        check_spec("a_spec", _spec(STANDINS=("no_such_standin",)))
    with pytest.raises(SpecError, match="STANDINS: 'ring_sdpa_cpu'"):
        check_spec("a_spec", _spec(STANDINS="ring_sdpa_cpu"))
