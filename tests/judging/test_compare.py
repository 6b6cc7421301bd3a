"""``cp_harness.judging.compare``: one type per kind of comparison, the ULP measure, locations; no pool."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cp_harness.judging.compare import (ExactComparison, ExcessVerdict, TokenGrid, UlpComparison, compare_exact,
                                        compare_ulp, eps_of, ulp_errors)


def test_exact_is_bit_for_bit_with_nan_equal_to_nan_and_negative_zero_to_zero():
    a = np.array([1.0, -0.0, np.nan, 2.0])
    assert compare_exact("t", a, np.array([1.0, 0.0, np.nan, 2.0])).ok
    bad = compare_exact("t", a, np.array([1.0, 0.0, np.nan, 2.0 + 2 ** -51]))
    assert isinstance(bad, ExactComparison) and not bad.arithmetic and not bad.ok
    assert bad.mismatched == 1 and bad.worst_index == (3,) and bad.max_abs == pytest.approx(2 ** -51)
    assert not compare_exact("t", np.array([np.nan]), np.array([1.0])).ok


def test_exact_refuses_another_dtype_or_shape_and_an_empty_selection():
    assert "dtype float32 but expected float64" in compare_exact("t", np.zeros(2, np.float32), np.zeros(2)).problem
    assert "shape [3] but expected [2]" in compare_exact("t", np.zeros(3), np.zeros(2)).problem
    empty = compare_exact("t", np.zeros((1, 3)), np.zeros((1, 3)), mask=np.zeros((1, 3), bool))
    assert empty.compared == 0 and not empty.ok  # a vacuous comparison is a failure


def test_bfloat16_tensors_are_compared_widened_exactly():
    x = torch.tensor([1.5, -3.25], dtype=torch.bfloat16)
    comp = compare_exact("t", x, x.float().numpy())
    assert comp.ok and comp.dtype == "float32"


def test_the_ulp_measure_is_relative_to_each_element_with_a_floor_at_the_tensor_scale():
    expected = np.array([1.0, 1e-9, -2.0])
    actual = expected + np.array([2, 0, -4]) * eps_of("float64")
    comp = compare_ulp("t", actual, expected, budget_ulp=2.0)
    assert isinstance(comp, UlpComparison) and comp.arithmetic
    assert comp.ok and comp.max_ulp == pytest.approx(2.0) and comp.scale == 2.0
    tight = compare_ulp("t", actual, expected, budget_ulp=1.5)
    assert not tight.ok and tight.mismatched == 2 and tight.worst_index in ((0,), (2,))
    # Near zero the floor (scale / 1024) is the unit: an absolute error of 1e-12 there is ~2.3e3 ULP.
    near = compare_ulp("t", np.array([1e-12, 2.0]), np.array([0.0, 2.0]), budget_ulp=1e9)
    assert near.max_ulp == pytest.approx(1e-12 / (eps_of("float64") * 2.0 / 1024))


def test_reference_scale_and_ulp_dtype_set_the_unit():
    comp = compare_ulp("g", np.array([1e-6]), np.array([0.0]), budget_ulp=4, ulp_dtype="bfloat16",
                       floor_fraction=1.0, reference_scale=1.0)
    assert comp.ulp_dtype == "bfloat16" and comp.max_ulp == pytest.approx(1e-6 / eps_of("bfloat16"))


def test_the_one_ulp_formula_treats_nan_on_one_side_as_infinite_and_on_both_as_none():
    e = np.array([1.0, np.nan, 1.0, 4.0])
    a = np.array([np.nan, np.nan, 1.0, 4.5])
    u = ulp_errors(a, e, 0.5, np.array([1.0, 1.0, 1.0, 2.0]))
    assert u[0] == math.inf and u[1] == 0.0 and u[2] == 0.0 and u[3] == pytest.approx(0.5)


def test_an_excess_verdict_fails_the_comparison_it_is_attached_to():
    comp = compare_ulp("t", np.ones(2), np.ones(2), budget_ulp=1.0)
    assert comp.ok
    comp.excess = ExcessVerdict(error=9.0, baseline=1.0, excess=4.5, limit=2.0, floor=1.0, mismatched=2)
    assert comp.excess.failed and not comp.ok
    data = comp.as_dict()
    assert data["kind"] == "ulp" and data["excess"]["excess"] == 4.5 and data["ok"] is False


def test_roles_are_fields_not_parts_of_the_name():
    comp = compare_exact("anything", np.zeros(1), np.zeros(1), rank=3, gradient=True)
    assert (comp.rank, comp.gradient) == (3, True)
    assert comp.as_dict()["rank"] == 3 and comp.as_dict()["gradient"] is True


def test_a_token_aligned_tensor_names_the_owner_and_the_distance_to_the_boundary():
    grid = TokenGrid(local_len=3, cp_size=2)
    actual = np.zeros((1, 6, 2))
    actual[0, 3, 1] = 1.0  # first token of rank 1
    comp = compare_exact("h", actual, np.zeros((1, 6, 2)), grid=grid)
    assert comp.location["owning_rank"] == 1 and comp.location["at_shard_boundary"]
    assert comp.error_map.shape == (1, 6) and comp.error_map[0, 3] > 0 and comp.error_map.sum() == comp.error_map[0, 3]
    assert comp.first_mismatches[0]["position"] == 3
