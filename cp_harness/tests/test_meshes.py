"""The documented functions, the sharder and both miniature models on world meshes as training builds them.

Every case is another check's own case on a drawn ``mesh_layout`` (``cp_harness.cases.meshes``): CP groups that
are not ranks ``0..N-1`` (CP as the inner and the outer dimension, meshes over the pool's last or scattered
ranks), several CP groups at once and a world larger than the CP group; each group must compute what one device
computes, and no rank may communicate outside its CP group. An implementation that addresses a peer by its CP
rank, reads its CP rank from the default group, or runs a collective on the default group fails here though
it passes every case on a mesh over ranks ``0..N-1``.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from cp_harness.cases import meshes
from cp_harness.cases.profiles import examples
from cp_harness.cases.strategies import mesh_layouts
from cp_harness.checks.meshes import FUNCTION_EXAMPLES, MESH_IDENTITY, MODEL_EXAMPLES, function_cases

FUNCTIONS, MODELS = MESH_IDENTITY.rows


@settings(max_examples=examples(0.3))
@given(case=FUNCTIONS.cases(None))
@MESH_IDENTITY.with_examples(where=lambda case: case in FUNCTION_EXAMPLES.values())
def test_gathers_halo_and_loss_on_world_meshes(cp_runner, case):
    cp_runner.check(case)


@settings(max_examples=examples(0.15))
@given(case=MODELS.cases(None))
@MESH_IDENTITY.with_examples(where=lambda case: case in MODEL_EXAMPLES.values())
def test_sharder_and_models_on_world_meshes(cp_runner, case):
    cp_runner.check(case)


@st.composite
def two_cases_on_one_mesh(draw):
    """Two different cases of one CP size on two CP groups of the same world mesh (sent together: they run at
    once, each on its own ranks)."""
    first = draw(function_cases(None))
    n = int(first["world_size"])
    second = draw(function_cases(None).filter(lambda c: int(c["world_size"]) == n))
    layout = draw(mesh_layouts(n, None, min_groups=2))
    a, b = draw(st.permutations(range(len(meshes.MeshLayout.parse(layout, cp_size=n).groups()))))[:2]
    return ({**first, meshes.KEY: {**layout, "run": [a]}}, {**second, meshes.KEY: {**layout, "run": [b]}})


@settings(max_examples=examples(0.1))
@given(pair=two_cases_on_one_mesh())
def test_different_cases_at_once_on_cp_groups_of_one_mesh(cp_runner, pair):
    for case, report in zip(pair, cp_runner.run_many(pair, ahead=1)):
        if not report.ok:
            cp_runner.check(case)  # the failure message of the case alone
