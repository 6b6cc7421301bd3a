"""World meshes as training builds them, named by a case (``case["mesh_layout"]``), and what follows from one.

A case without ``mesh_layout`` runs as it always has: on a one-dimensional CP mesh over pool ranks
``0..N-1`` (``N = world_size``), where a rank's CP rank is its global rank. A case with one runs on the CP
groups of a world mesh of one to three dimensions (``dp x cp``, ``dp_shard x cp x tp``, ...), and every rank
of a CP group receives ``world_mesh["cp"]``, as a training framework hands it to the model::

    "mesh_layout": {"dims": ["dp", "cp"], "shape": [2, 2], "ranks": [4, 5, 6, 7], "run": [1]}

- ``dims``: dimension names (``DIM_NAMES``), ``"cp"`` exactly once;
- ``shape``: the size of each dimension; the ``cp`` one is the case's ``world_size``;
- ``ranks``: the pool ranks the world mesh covers, increasing, laid out row-major over ``shape`` (default
  ``0..prod(shape)-1``); pool ranks outside it take no part in the case;
- ``run``: the indices of the CP groups that run the case (default: every group, all at once, the same case).

CP group ``g`` is row ``g`` (row-major over the other dimensions) of the world mesh with its ``cp`` dimension
moved last. Its CP rank ``i`` is its ``i``-th smallest global rank: torch orders a process group's ranks
ascending, and a mesh laid out over increasing ranks agrees with that order along every dimension. So
``dp x cp = 2 x 2`` over ``0..3`` has the CP groups ``{0, 1}`` and ``{2, 3}``, and ``cp x dp`` has ``{0, 2}``
and ``{1, 3}``: CP as the inner and as the outer dimension.

Pure data, no torch: the pool (``cp_harness.ranks``) builds a layout's mesh on every pool rank (building a
mesh creates process groups, which every rank of the default group must do) and sends the case to
``case_ranks``; the runner judges each CP group apart, as an ordinary case.
"""

from __future__ import annotations

import dataclasses
import json
import math

KEY = "mesh_layout"
# The dimension names training frameworks give a world mesh (torchtitan, nemo-automodel).
DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "dp", "cp", "tp")
MAX_DIMS = 3


class MeshLayoutError(ValueError):
    """A ``mesh_layout`` that cannot be built; the message names the field and what to give instead."""


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A world mesh over pool ranks and the CP groups of it that run a case (see the module docstring)."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    run: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ reading and checking
    @classmethod
    def of(cls, case: dict, pool_size: int | None = None) -> MeshLayout | None:
        """The layout ``case`` names (``None``: today's one-dimensional mesh over ``0..N-1``), checked against
        the case's CP size and, given ``pool_size``, the pool; ``MeshLayoutError`` naming the field otherwise."""
        spec = case.get(KEY)
        if spec is None:
            return None
        return cls.parse(spec, cp_size=int(case["world_size"]), pool_size=pool_size)

    @classmethod
    def parse(cls, spec, *, cp_size: int | None = None, pool_size: int | None = None) -> MeshLayout:
        if not isinstance(spec, dict):
            raise MeshLayoutError(f"{KEY}: expected an object with dims and shape, got {type(spec).__name__}")
        unknown = sorted(set(spec) - {"dims", "shape", "ranks", "run"})
        if unknown:
            raise MeshLayoutError(f"{KEY}: unknown key(s) {unknown}; give dims, shape and optionally ranks, run")
        dims, shape = spec.get("dims"), spec.get("shape")
        if not isinstance(dims, list) or not dims or len(dims) > MAX_DIMS:
            raise MeshLayoutError(
                f'{KEY}.dims: give a list of 1 to {MAX_DIMS} dimension names, e.g. ["dp", "cp"], got {dims!r}'
            )
        bad = [d for d in dims if d not in DIM_NAMES]
        if bad or len(set(dims)) != len(dims):
            raise MeshLayoutError(f"{KEY}.dims: {dims!r}: names must be distinct, from {list(DIM_NAMES)}")
        if dims.count("cp") != 1:
            raise MeshLayoutError(f'{KEY}.dims: {dims!r} has no "cp" dimension; the case runs on mesh["cp"]')
        if (
            not isinstance(shape, list)
            or len(shape) != len(dims)
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape)
        ):
            raise MeshLayoutError(f"{KEY}.shape: give one positive integer per dimension of {dims}, got {shape!r}")
        cp = dims.index("cp")
        if cp_size is not None and shape[cp] != cp_size:
            raise MeshLayoutError(
                f'{KEY}.shape[{cp}] (the "cp" dimension) is {shape[cp]}, but world_size is '
                f"{cp_size}: the cp dimension is the CP size"
            )
        size = math.prod(shape)
        ranks = spec.get("ranks", list(range(size)))
        if (
            not isinstance(ranks, list)
            or len(ranks) != size
            or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks)
        ):
            raise MeshLayoutError(f"{KEY}.ranks: give {size} pool ranks (prod(shape)), got {ranks!r}")
        if any(b <= a for a, b in zip(ranks, ranks[1:])):
            raise MeshLayoutError(
                f"{KEY}.ranks: {ranks} must increase: torch orders a group's ranks ascending, so a "
                f"mesh over ranks in another order would disagree with its own groups"
            )
        if pool_size is not None and ranks[-1] >= pool_size:
            raise MeshLayoutError(
                f"{KEY}.ranks: rank {ranks[-1]} is not in a pool of {pool_size} ranks; start a "
                f"pool of at least {ranks[-1] + 1}"
            )
        groups = size // shape[cp]
        run = spec.get("run")
        if run is not None:
            if (
                not isinstance(run, list)
                or not run
                or len(set(run)) != len(run)
                or any(not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < groups for g in run)
            ):
                raise MeshLayoutError(f"{KEY}.run: give distinct CP group indices in 0..{groups - 1}, got {run!r}")
            run = tuple(sorted(run))
        return cls(tuple(dims), tuple(shape), tuple(ranks), run)

    # ------------------------------------------------------------------ what follows
    @property
    def cp_dim(self) -> int:
        return self.dims.index("cp")

    @property
    def cp_size(self) -> int:
        return self.shape[self.cp_dim]

    @property
    def key(self) -> str:
        """Which mesh this is (``run`` apart: cases on other groups of the same mesh share it)."""
        return json.dumps(
            {"dims": list(self.dims), "shape": list(self.shape), "ranks": list(self.ranks)}, separators=(",", ":")
        )

    def nested(self) -> list:
        """The world mesh as nested lists of global ranks, ``shape`` deep (what ``DeviceMesh`` is given)."""

        def build(flat: list[int], shape: tuple[int, ...]) -> list:
            if len(shape) == 1:
                return list(flat)
            step = len(flat) // shape[0]
            return [build(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]

        return build(list(self.ranks), self.shape)

    def groups(self) -> list[tuple[int, ...]]:
        """Every CP group's global ranks in CP rank order, groups in row-major order of the other dimensions."""
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        others = [d for d in range(len(self.shape)) if d != self.cp_dim]
        out = []
        for index in range(math.prod(self.shape[d] for d in others)):
            base, rest = 0, index
            for d in reversed(others):
                base += (rest % self.shape[d]) * strides[d]
                rest //= self.shape[d]
            out.append(tuple(self.ranks[base + i * strides[self.cp_dim]] for i in range(self.cp_size)))
        return out

    def running(self) -> list[int]:
        """The indices of the CP groups that run the case."""
        return list(self.run) if self.run is not None else list(range(len(self.groups())))

    def case_ranks(self) -> list[int]:
        """The pool ranks a case on this layout is sent to, ascending."""
        groups = self.groups()
        return sorted(r for g in self.running() for r in groups[g])

    def place(self, rank: int) -> tuple[int, int] | None:
        """``(CP group index, CP rank)`` of pool rank ``rank``, ``None`` when it is not in the world mesh."""
        for g, members in enumerate(self.groups()):
            if rank in members:
                return g, members.index(rank)
        return None

    def label(self) -> str:
        """``dp x cp = 2 x 2 over ranks [4, 5, 6, 7]``."""
        over = "" if self.ranks == tuple(range(len(self.ranks))) else f" over ranks {list(self.ranks)}"
        return f"{' x '.join(self.dims)} = {' x '.join(str(s) for s in self.shape)}{over}"

    def group_label(self, g: int) -> str:
        """``CP group 1 (global ranks [2, 3]) of dp x cp = 2 x 2``."""
        return f"CP group {g} (global ranks {list(self.groups()[g])}) of {self.label()}"

    def describe(self, rank: int) -> str:
        """``CP rank 1 of CP group 1 (global ranks [1, 3]) of cp x dp = 2 x 2`` for pool rank ``rank``."""
        where = self.place(rank)
        if where is None:
            return f"not in the world mesh {self.label()}"
        return f"CP rank {where[1]} of {self.group_label(where[0])}"

    def as_dict(self) -> dict:
        out: dict = {"dims": list(self.dims), "shape": list(self.shape), "ranks": list(self.ranks)}
        if self.run is not None:
            out["run"] = list(self.run)
        return out


# ---------------------------------------------------------------------- any case
def case_groups(case: dict) -> list[tuple[int, ...]]:
    """The CP groups a case runs on, each as global ranks in CP rank order (today's case: ``[(0, .., N-1)]``)."""
    layout = MeshLayout.of(case)
    if layout is None:
        return [tuple(range(int(case["world_size"])))]
    groups = layout.groups()
    return [groups[g] for g in layout.running()]


def case_ranks(case: dict) -> list[int]:
    """The pool ranks ``case`` is sent to, ascending."""
    return sorted(r for group in case_groups(case) for r in group)


def ranks_needed(case: dict) -> int:
    """The smallest pool that can run ``case``: ``world_size`` ranks, or one past the highest rank of its mesh."""
    layout = MeshLayout.of(case)
    return int(case["world_size"]) if layout is None else layout.ranks[-1] + 1


def mesh_key(case: dict) -> str:
    """Which mesh the ranks must hold to run ``case``: its layout's key, else ``"prefix:N"``."""
    layout = MeshLayout.of(case)
    return f"prefix:{int(case['world_size'])}" if layout is None else layout.key


def without_layout(case: dict) -> dict:
    """The same case on today's one-dimensional mesh over ``0..N-1``."""
    return {k: v for k, v in case.items() if k != KEY}
