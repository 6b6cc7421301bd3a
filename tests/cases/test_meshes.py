"""World-mesh layouts (``cp_harness.cases.meshes``): which ranks form each CP group, and clear errors for layouts
that cannot be built. Pure: no rank runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_harness.cases import meshes
from cp_harness.cases.meshes import MeshLayout, MeshLayoutError
from cp_harness.cases.profiles import CaseSpace
from cp_harness.cases.strategies import mesh_layouts


def case(n: int, **layout) -> dict:
    return {"check": "x", "world_size": n, meshes.KEY: layout}


def test_cp_inner_and_outer_give_the_groups_training_gives():
    assert MeshLayout.of(case(2, dims=["dp", "cp"], shape=[2, 2])).groups() == [(0, 1), (2, 3)]
    assert MeshLayout.of(case(2, dims=["cp", "dp"], shape=[2, 2])).groups() == [(0, 2), (1, 3)]
    three = MeshLayout.of(case(2, dims=["dp_shard", "cp", "tp"], shape=[2, 2, 2]))
    assert three.groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    over = MeshLayout.of(case(4, dims=["dp", "cp"], shape=[1, 4], ranks=[4, 5, 6, 7], run=[0]))
    assert over.groups() == [(4, 5, 6, 7)] and over.case_ranks() == [4, 5, 6, 7]
    assert meshes.ranks_needed(case(4, dims=["dp", "cp"], shape=[1, 4], ranks=[4, 5, 6, 7])) == 8


def test_a_case_without_a_layout_is_todays_case():
    plain = {"check": "x", "world_size": 3}
    assert MeshLayout.of(plain) is None
    assert meshes.case_groups(plain) == [(0, 1, 2)] and meshes.case_ranks(plain) == [0, 1, 2]
    assert meshes.mesh_key(plain) == "prefix:3" and meshes.ranks_needed(plain) == 3


def test_run_selects_groups_and_place_names_a_rank():
    layout = MeshLayout.of(case(2, dims=["cp", "dp"], shape=[2, 2], run=[1]))
    assert layout.case_ranks() == [1, 3] and layout.place(3) == (1, 1) and layout.place(2) == (0, 1)
    assert layout.describe(3) == "CP rank 1 of CP group 1 (global ranks [1, 3]) of cp x dp = 2 x 2"
    assert meshes.without_layout(case(2, dims=["cp", "dp"], shape=[2, 2])) == {"check": "x", "world_size": 2}


@pytest.mark.parametrize(("layout", "n", "says"), [
    ({"dims": ["dp", "tp"], "shape": [2, 2]}, 2, 'no "cp" dimension'),
    ({"dims": ["dp", "cp"], "shape": [2, 3]}, 2, "shape[1] (the \"cp\" dimension) is 3, but world_size is 2"),
    ({"dims": ["dp", "cp", "tp", "pp"], "shape": [1, 2, 1, 1]}, 2, "1 to 3 dimension names"),
    ({"dims": ["dp", "xp"], "shape": [2, 2]}, 2, "from ['pp'"),
    ({"dims": ["dp", "cp"], "shape": [2, 0]}, 2, "shape: give one positive integer"),
    ({"dims": ["dp", "cp"], "shape": [2, 2], "ranks": [0, 1, 2]}, 2, "ranks: give 4 pool ranks"),
    ({"dims": ["dp", "cp"], "shape": [2, 2], "ranks": [0, 2, 1, 3]}, 2, "must increase"),
    ({"dims": ["dp", "cp"], "shape": [2, 2], "run": [2]}, 2, "run: give distinct CP group indices in 0..1"),
    ({"dims": ["dp", "cp"], "shape": [2, 2], "order": "x"}, 2, "unknown key(s) ['order']"),
    ("dp x cp", 2, "expected an object"),
])
def test_a_layout_that_cannot_be_built_names_the_field(layout, n, says):
    with pytest.raises(MeshLayoutError, match="mesh_layout") as error:
        MeshLayout.of({"check": "x", "world_size": n, meshes.KEY: layout})
    assert says in str(error.value), str(error.value)


def test_a_layout_larger_than_the_pool_says_how_large_a_pool_it_needs():
    with pytest.raises(MeshLayoutError, match="start a pool of at least 8"):
        MeshLayout.of(case(4, dims=["dp", "cp"], shape=[2, 4]), pool_size=4)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), cp=st.integers(1, 8), pool=st.integers(8, 16))
def test_drawn_layouts_fit_the_pool_and_split_it_into_disjoint_cp_groups(data, cp, pool):
    spec = data.draw(mesh_layouts(cp, CaseSpace(world_sizes=(1, 2, 3, 4, 8), pool_size=pool)))
    layout = MeshLayout.parse(spec, cp_size=cp, pool_size=pool)
    groups = layout.groups()
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(layout.ranks) and len(set(flat)) == len(flat)
    assert all(len(g) == cp and list(g) == sorted(g) for g in groups)  # CP rank i: the i-th smallest rank
    assert 2 <= len(layout.dims) <= 3 and layout.dims.count("cp") == 1
    assert set(layout.case_ranks()) <= set(layout.ranks)
