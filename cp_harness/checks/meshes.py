"""Cases on world meshes as training builds them (``cp_harness.cases.meshes``), and the check that the pool hands
every rank the right ``world_mesh["cp"]``.

``mesh_identity``: every rank of every CP group that runs the case reports what its mesh says (size, local rank,
the global ranks of its group, the world mesh's dimension names and shape) and all-gathers its global rank over
the CP mesh's group; the test process requires the layout's answer for each (CP rank ``i`` of a group is its
``i``-th global rank). It judges the harness, not an implementation.

The verify rows here judge the implementation on world meshes: the other checks' own cases (their verify
rows' strategies), each given a drawn ``mesh_layout`` (``strategies.with_mesh_layout``), so that the CP
groups are not ranks ``0..N-1``, CP is the inner or the outer dimension, several CP groups run at once and
the world is larger than the CP group. A sharder is resolved with the world mesh (``device_mesh["cp"]`` is
its CP mesh), the functions get ``world_mesh["cp"]``; the communication meter confines each rank to its CP
group (``cp_harness.instruments.leaks``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from hypothesis import strategies as st

from cp_harness.cases.meshes import KEY, MeshLayout
from cp_harness.cases.strategies import as_space, seeds, with_mesh_layout, world_sizes
from cp_harness.checks import VerifyRow, register
from cp_harness.checks.loss import SHIFTED_CP_LOSS
from cp_harness.checks.models import MODEL
from cp_harness.checks.sharder_roundtrip import SHARDER_ROUNDTRIP
from cp_harness.checks.transport import CONVOLUTION_HISTORY, GATHER_SEQUENCE, GATHER_TOKENS
from cp_harness.judging.compare import compare_exact
from cp_harness.judging.verdicts import CaseReport


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    mesh = ctx.mesh_for(case)
    if mesh is None:
        return {"cp_rank": ctx.rank, "size": 1}, {"gathered": torch.tensor([ctx.global_rank])}
    group = mesh.get_group()
    root = mesh._get_root_mesh()  # the world mesh this CP mesh was sliced from (itself for a 1-D one)
    info = {
        "cp_rank": int(mesh.get_local_rank()),
        "size": int(mesh.size()),
        "group_rank": dist.get_rank(group),
        "members": list(dist.get_process_group_ranks(group)),
        "dims": list(root.mesh_dim_names or ()),
        "shape": list(root.mesh.shape),
        "context_rank": ctx.rank,
        "global_rank": dist.get_rank(),
    }
    mine = torch.tensor([dist.get_rank()], dtype=torch.int64, device=ctx.device)
    out = torch.empty(int(mesh.size()), dtype=torch.int64, device=ctx.device)
    if int(mesh.size()) > 1:
        dist.all_gather_single(out, mine, group=group)
    else:
        out.copy_(mine)
    return info, {"gathered": out}


def _evaluate(case: dict, outputs: list) -> CaseReport:
    report = CaseReport(case=case)
    layout = MeshLayout.of(case)
    n = int(case["world_size"])
    for o in outputs:
        info = o.info
        expected = (
            list(range(n)) if layout is None else list(next(g for g in layout.groups() if info.get("global_rank") in g))
        )
        report.add(
            compare_exact(
                f"global ranks gathered over the CP group@rank{o.rank}",
                o.tensors["gathered"],
                np.array(expected, dtype=np.int64),
                rank=o.rank,
            )
        )
        if info.get("size", 1) == 1 and "members" not in info:
            continue
        wanted = {
            "cp_rank": o.rank,
            "size": n,
            "group_rank": o.rank,
            "members": expected,
            "context_rank": o.rank,
            "global_rank": expected[o.rank],
        }
        if layout is not None:
            wanted.update(dims=list(layout.dims), shape=list(layout.shape))
        for key, value in wanted.items():
            report.require(
                info.get(key) == value,
                f"CP rank {o.rank}: its mesh says {key} = {info.get(key)!r}, the layout {value!r}",
                rank=o.rank,
            )
    return report


@st.composite
def identity_cases(draw, space=None) -> dict:
    space = as_space(space)
    case = {"check": "mesh_identity", "world_size": draw(world_sizes(space)), "seed": draw(seeds)}
    return draw(with_mesh_layout(case, space))


def _rows_of(*checks_) -> tuple:
    return tuple(row for check in checks_ for row in check.rows)


_FUNCTION_SOURCES = _rows_of(GATHER_SEQUENCE, GATHER_TOKENS, CONVOLUTION_HISTORY, SHIFTED_CP_LOSS)
_MODEL_SOURCES = _rows_of(SHARDER_ROUNDTRIP) + tuple(r for r in MODEL.rows if "float64" in r.dtypes)


def function_cases(space=None):
    """A case of the gathers, the halo or the shifted loss (their own verify rows' strategies), no mesh yet."""
    return st.one_of(*(row.cases(space) for row in _FUNCTION_SOURCES))


def _on_meshes(sources, space):
    """The sources' own cases, each on a drawn world mesh."""
    return st.one_of(*(row.cases(space) for row in sources)).flatmap(lambda case: with_mesh_layout(case, space))


def _layout(dims, shape, ranks=None, run=None) -> dict:
    out = {"dims": list(dims), "shape": list(shape)}
    if ranks is not None:
        out["ranks"] = list(ranks)
    if run is not None:
        out["run"] = list(run)
    return out


# Each fits four ranks; each claimed function is called by one of them whatever the drawn cases call.
FUNCTION_EXAMPLES = {
    "gather_sequence-dp2xcp2": GATHER_SEQUENCE.case(
        world_size=2,
        seed=201,
        dtype="float32",
        shape=[2, 3, 2],
        differentiable=True,
        **{KEY: _layout(("dp", "cp"), (2, 2))},
    ),
    "convolution_history-cp2xdp2": CONVOLUTION_HISTORY.case(  # CP as the outer dimension: groups {0, 2}, {1, 3}
        world_size=2, seed=202, dtype="float64", shape=[2, 3, 2], width=3, **{KEY: _layout(("cp", "dp"), (2, 2))}
    ),
    "gather_tokens-cp3-of-ranks-1-3": GATHER_TOKENS.case(
        world_size=3,
        seed=203,
        dtype="bfloat16",
        shape=[2, 3],
        differentiable=True,
        **{KEY: _layout(("dp_shard", "cp", "tp"), (1, 3, 1), ranks=(1, 2, 3))},
    ),
    "shifted_cp_loss-group1-of-dp2xcp2": SHIFTED_CP_LOSS.case(
        world_size=2,
        seed=204,
        model="mistral_large4",
        dtype="float64",
        vocab=7,
        batch={"format": "thd", "seq_len": 10, "docs": [[[4, 5], [5, 5]]]},
        **{KEY: _layout(("dp", "cp"), (2, 2), run=(1,))},
    ),
}
MODEL_EXAMPLES = {
    "sharder_roundtrip-cp2xdp2": SHARDER_ROUNDTRIP.case(
        world_size=2, seed=205, dtype="float64", shape=[2, 5, 3], **{KEY: _layout(("cp", "dp"), (2, 2))}
    ),
    "model-inkling2-ranks-1-3": MODEL.case(
        world_size=2,
        seed=206,
        model="inkling2",
        dtype="float64",
        num_chunks=1,
        batch={"format": "thd", "seq_len": 9, "docs": [[[3, 3], [6, 6]]]},
        **{KEY: _layout(("dp", "cp", "tp"), (1, 2, 1), ranks=(1, 3))},
    ),
    "model-mistral_large4-dp2xcp2": MODEL.case(
        world_size=2,
        seed=207,
        model="mistral_large4",
        dtype="float64",
        num_chunks=1,
        shard_primary=True,
        batch={"format": "bshd", "seq_len": 8, "rows": [[1, 7], [0, 8]]},
        **{KEY: _layout(("dp", "cp"), (2, 2))},
    ),
}

MESH_IDENTITY = register(
    "mesh_identity",
    rank=_rank,
    evaluate=_evaluate,
    rows=(
        VerifyRow(
            'meshes: gathers, halo, loss on world_mesh["cp"] (2-D/3-D)',
            lambda space: _on_meshes(_FUNCTION_SOURCES, space),
            (
                "inkling2.gather_sequence",
                "mistral_large4.gather_tokens",
                "inkling2.convolution_history",
                "mistral_large4.shifted_cp_loss",
            ),
            tuple(sorted({d for r in _FUNCTION_SOURCES for d in r.dtypes})),
            explicit=tuple(FUNCTION_EXAMPLES.values()),
            position=12,
            id="meshes.functions",
        ),
        VerifyRow(
            "meshes: sharder and both models on a world mesh",
            lambda space: _on_meshes(_MODEL_SOURCES, space),
            (
                "sharder.shard",
                "sharder.shard_token_tensor",
                "sharder.gather_token_tensor",
                "inkling2.prepare_cp_inputs",
                "mistral_large4.prepare_cp_inputs",
            ),
            tuple(sorted({d for r in _MODEL_SOURCES for d in r.dtypes})),
            explicit=tuple(MODEL_EXAMPLES.values()),
            position=13,
            id="meshes.models",
        ),
    ),
    examples={**FUNCTION_EXAMPLES, **MODEL_EXAMPLES},
)
