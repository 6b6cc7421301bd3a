"""Comparisons: one type per kind of judgement, in the manner of ``torch.testing._comparison``.

- ``ExactComparison`` (``compare_exact``): pure data movement (gathers, halos, sharding, layout). Every
  element must be bit-identical (``-0.0`` equals ``0.0``; NaN equals NaN only when both are NaN at the same
  place).
- ``UlpComparison`` (``compare_ulp``): arithmetic. The error of an element is measured in units in the
  last place of the compared dtype, relative to ``max(|expected|, floor)`` where
  ``floor = floor_fraction * max|expected|`` over the tensor (``ulp_errors``, the one ULP formula of the
  harness): ``ulp = |actual - expected| / (eps(dtype) * max(|expected|, floor))``. With the default
  ``floor_fraction = 1/1024`` each element is judged nearly on its own (near-zero elements produced by
  cancellation against 1/1024 of the tensor's scale); ``floor_fraction = 1`` is the normwise measure (every
  element against the tensor's largest magnitude).

  ``reference_scale`` widens "the tensor's largest magnitude" to a family of tensors
  (``max(own, reference_scale)``): parameter gradients are judged against the largest gradient of the model,
  because a gradient that is mathematically zero (a one-key softmax row, identical values) is computed as
  rounding noise of the terms that formed it, and has no scale of its own.

``ulp_dtype`` may be ``"bfloat16"`` or ``"float16"`` too (``cases.EPS``); bfloat16 tensors arrive widened to
float32, which is exact, so an exact comparison still means bit for bit.

Beside its ULP budget, an arithmetic comparison of a multi-rank case can carry an ``ExcessVerdict``
(``UlpComparison.excess``, set by ``cp_harness.judging.excess``): the same tensor computed by the same
implementation on one rank has its own error against the oracle, and CP may add at most ``c`` times that
error plus a floor. The per-element values and errors are kept for that judge and for the error map of an
excess failure.

Roles are typed fields, not parts of a name: ``rank`` (the tensor of one rank; ``None`` for a global one)
and ``gradient`` (the tensor is a gradient). A comparison records how many elements were compared, how many
exceed the budget, the largest error and where it is. When the tensor is token-aligned (``[batch, sequence,
...]`` in global order) the location also names the owning CP rank and the distance to the nearest shard
boundary. Nothing here renders text: ``cp_harness.judging.render`` does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, TypeVar

import numpy as np

from cp_harness.cases.descriptions import EPS

FLOOR_FRACTION = 1.0 / 1024.0


def eps_of(dtype_name: str) -> float:
    """Machine epsilon of a dtype name (``"bfloat16"`` included, which numpy does not know)."""
    if dtype_name in EPS:
        return EPS[dtype_name]
    return float(np.finfo(np.dtype(dtype_name)).eps)


@dataclasses.dataclass(frozen=True)
class TokenGrid:
    """How a ``[batch, padded_sequence, ...]`` tensor in global order maps onto CP shards.

    ``local_len`` tokens per rank, ``cp_size`` ranks; ``owners``: the owning rank of
    every global position (any index map: contiguous, load-balanced, ...);
    ``None`` means contiguous (rank ``r`` owns ``[r*L, (r+1)*L)``). A shard
    boundary is where the owner changes between two neighbouring positions (the
    sequence's first and last positions are not boundaries). ``seq_len``: the
    real length ``S`` when known (positions ``>= S`` are divisibility padding);
    ``start``: the global position of index 0 of a compared slice (``sliced``).
    """

    local_len: int
    cp_size: int
    owners: tuple[int, ...] | None = None
    seq_len: int | None = None
    start: int = 0

    @classmethod
    def from_index_maps(cls, index_maps: list, seq_len: int | None = None) -> TokenGrid:
        """The grid of a layout given each rank's ``local_token_global_indices`` (rank order)."""
        local_len = len(index_maps[0]) if index_maps else 0
        total = sum(len(m) for m in index_maps)
        owners = [0] * total
        for rank, indices in enumerate(index_maps):
            for g in np.asarray(indices).reshape(-1).tolist():
                if 0 <= g < total:
                    owners[g] = rank
        return cls(local_len, len(index_maps), tuple(owners), seq_len)

    def sliced(self, start: int) -> TokenGrid:
        """The grid of a comparison of positions ``start:`` (index ``j`` is global position ``start + j``)."""
        return dataclasses.replace(self, start=self.start + start)

    @property
    def length(self) -> int:
        return len(self.owners) if self.owners is not None else self.local_len * self.cp_size

    def owner(self, position: int) -> int:
        if self.owners is not None:
            return self.owners[position] if 0 <= position < len(self.owners) else self.cp_size - 1
        return min(position // self.local_len, self.cp_size - 1) if self.local_len else 0

    def segments(self, length: int | None = None) -> list[tuple[int, int, int]]:
        """``(start, end, rank)`` of every maximal run of positions one rank owns, in global order."""
        length = length if length is not None else self.length
        out: list[tuple[int, int, int]] = []
        for p in range(length):
            r = self.owner(p)
            if out and out[-1][2] == r and out[-1][1] == p:
                out[-1] = (out[-1][0], p + 1, r)
            else:
                out.append((p, p + 1, r))
        return out

    def describe(self, row: int, index: int) -> dict[str, Any]:
        """Where element ``index`` along the sequence axis lies: global position, owning rank, its distance to the
        nearest shard boundary (``None`` when the layout has none: one rank), whether it is divisibility padding."""
        position = self.start + index
        owner = self.owner(position)
        boundaries = [p for p in range(1, self.length) if self.owner(p) != self.owner(p - 1)]
        # A boundary between p-1 and p: position p-1 is 0 tokens from it on the left, p on the right.
        distance = min((p - 1 - position if position < p else position - p for p in boundaries), default=None)
        return {
            "row": row,
            "position": position,
            "owning_rank": owner,
            "distance_to_shard_boundary": distance,
            "at_shard_boundary": distance == 0,
            "divisibility_padding": self.seq_len is not None and position >= self.seq_len,
        }


@dataclasses.dataclass(frozen=True)
class ExcessVerdict:
    """The excess judge's verdict on one arithmetic tensor (``cp_harness.judging.excess``): the CP error and
    the one-rank baseline's error in the judge's normwise measure (ULPs of the compared dtype), the ratio
    ``excess = error / (baseline + floor / limit)``, the limit ``c`` it must not exceed, the floor ``k`` (ULPs at
    the tensor's scale), and how many elements lie above ``c x baseline + floor``."""

    error: float
    baseline: float
    excess: float
    limit: float
    floor: float
    mismatched: int = 0

    @property
    def failed(self) -> bool:
        return not self.excess <= self.limit


@dataclasses.dataclass
class Comparison:
    """Outcome of comparing one named tensor (the common part of both kinds). ``ok`` is False when any element
    fails, shapes differ, or nothing was compared."""

    arithmetic: ClassVar[bool] = False
    kind: ClassVar[str] = ""

    name: str
    dtype: str
    shape: tuple[int, ...]
    compared: int = 0
    mismatched: int = 0
    max_abs: float = 0.0
    rank: int | None = None  # the tensor of this rank (None: a global tensor)
    gradient: bool = False  # the tensor is a gradient (what a backward returned)
    # On a world mesh (cp_harness.cases.meshes): the CP group whose tensor this is ("CP group 1 (global ranks
    # [2, 3]) of dp x cp = 2 x 2"); ``rank`` is then a CP rank of that group. None: today's mesh over 0..N-1.
    group: str | None = None
    worst_index: tuple[int, ...] | None = None
    worst_actual: float | None = None
    worst_expected: float | None = None
    location: dict[str, Any] | None = None
    problem: str | None = None
    first_mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # For failing token-aligned tensors: max error per (row, global position), and the shard grid.
    error_map: np.ndarray | None = dataclasses.field(default=None, repr=False)
    grid: TokenGrid | None = None
    error_map_unit: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and self.mismatched == 0 and self.compared > 0

    def as_dict(self) -> dict[str, Any]:
        """The comparison as JSON-ready data (``kind`` names its type)."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("error_map", "ulp_values", "element_values", "scale", "grid", "excess")
        }
        data["kind"] = self.kind
        data["grid"] = dataclasses.asdict(self.grid) if self.grid is not None else None
        data["ok"] = self.ok
        data["shape"] = list(self.shape)
        data["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        if self.group is None:  # reports of cases without a mesh_layout read as they always have
            del data["group"]
        return data


@dataclasses.dataclass
class ExactComparison(Comparison):
    """Bit for bit: data movement."""

    kind: ClassVar[str] = "exact"


@dataclasses.dataclass
class UlpComparison(Comparison):
    """Within ``budget_ulp`` ULPs of ``ulp_dtype`` (``inf``: judged by its excess over one rank alone)."""

    arithmetic: ClassVar[bool] = True
    kind: ClassVar[str] = "ulp"

    budget_ulp: float = math.inf
    max_ulp: float = 0.0
    ulp_dtype: str | None = None
    floor_fraction: float | None = None
    scale: float | None = None  # the tensor's scale (largest expected magnitude, or reference_scale)
    # The error of every element in ULPs (0 where not selected), and the (actual, expected) arrays: for the
    # excess judge and error maps.
    ulp_values: np.ndarray | None = dataclasses.field(default=None, repr=False)
    element_values: tuple | None = dataclasses.field(default=None, repr=False)
    excess: ExcessVerdict | None = None

    @property
    def ok(self) -> bool:
        return super().ok and not (self.excess is not None and self.excess.failed)

    def as_dict(self) -> dict[str, Any]:
        data = super().as_dict()
        data["excess"] = dataclasses.asdict(self.excess) if self.excess is not None else None
        return data


def _as_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()  # exact: every bfloat16 is a float32
        value = value.numpy()
    return np.asarray(value)


def _float(x) -> float | int | bool:
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    return float(x)


def ulp_errors(actual: np.ndarray, expected: np.ndarray, eps: float, unit: np.ndarray | float) -> np.ndarray:
    """``|actual - expected| / (eps x unit)`` element by element (float64), the one ULP formula of the harness:
    ``unit`` is the magnitude an element's error is measured against (``max(|expected|, floor)``; the scale
    itself for the normwise measure). A NaN on one side only is an infinite error, NaN on both sides none."""
    a64, e64 = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ulp = np.abs(a64 - e64) / (eps * unit)
    ulp = np.where(np.isnan(ulp) | (np.isnan(a64) != np.isnan(e64)), np.inf, ulp)
    return np.where(np.isnan(a64) & np.isnan(e64), 0.0, ulp)


def _selection(e: np.ndarray, mask) -> np.ndarray:
    if mask is None:
        return np.ones(e.shape, dtype=bool)
    m = _as_numpy(mask).astype(bool)
    return np.broadcast_to(m.reshape(m.shape + (1,) * (e.ndim - m.ndim)), e.shape)


_C = TypeVar("_C", bound="Comparison")


def _locate(
    comp: _C,
    a: np.ndarray,
    e: np.ndarray,
    bad: np.ndarray,
    score: np.ndarray,
    diff: np.ndarray,
    select: np.ndarray,
    grid: TokenGrid | None,
) -> _C:
    """The parts both kinds share once each element has a score: counts, worst element, locations, error map."""
    comp.mismatched = int(bad.sum())
    comp.max_abs = float(np.max(np.where(select, diff, 0.0))) if diff.size else 0.0
    if comp.max_abs != comp.max_abs:  # NaN
        comp.max_abs = math.inf
    worst = np.unravel_index(int(np.argmax(score)), e.shape) if e.size else None
    if worst is not None:
        comp.worst_index = tuple(int(i) for i in worst)
        comp.worst_actual = _float(a[worst])
        comp.worst_expected = _float(e[worst])
        if grid is not None and e.ndim >= 2:
            comp.location = grid.describe(int(worst[0]), int(worst[1]))
    if grid is not None and e.ndim >= 2:
        comp.grid = grid
    if comp.mismatched and grid is not None and grid.start == 0 and e.ndim >= 2:  # a picture of whole rows only
        per_element = np.where(bad, np.where(np.isfinite(score), np.maximum(score, 0.0), np.inf), 0.0)
        if per_element.ndim > 2:
            per_element = per_element.reshape(per_element.shape[0], per_element.shape[1], -1).max(axis=-1)
        comp.error_map = per_element
    if comp.mismatched:
        for idx in np.argwhere(bad)[:5]:
            idx = tuple(int(i) for i in idx)
            entry = {"index": list(idx), "actual": _float(a[idx]), "expected": _float(e[idx])}
            if grid is not None and e.ndim >= 2:
                entry.update(grid.describe(idx[0], idx[1]))
            comp.first_mismatches.append(entry)
    return comp


def compare_exact(
    name: str,
    actual,
    expected,
    *,
    mask=None,
    grid: TokenGrid | None = None,
    rank: int | None = None,
    gradient: bool = False,
) -> ExactComparison:
    """``actual`` bit for bit against ``expected`` (same shape and dtype).

    ``mask``: optional bool array broadcastable to the leading dims of the tensors; only selected elements are
    compared (an empty selection fails). ``grid``: when the tensor is ``[batch, sequence, ...]`` in global
    token order, used to name the owning rank and boundary distance of the worst element. ``rank``,
    ``gradient``: the tensor's role (see the module docstring)."""
    a, e = _as_numpy(actual), _as_numpy(expected)
    comp = ExactComparison(name=name, dtype=str(a.dtype), shape=tuple(e.shape), rank=rank, gradient=gradient)
    if a.shape != e.shape:
        comp.problem = f"shape {list(a.shape)} but expected {list(e.shape)}"
        return comp
    if a.dtype != e.dtype:
        comp.problem = f"dtype {a.dtype} but expected {e.dtype} (data movement must preserve dtype)"
        return comp
    select = _selection(e, mask)
    comp.compared = int(select.sum())
    if comp.compared == 0:
        return comp
    same = ((a == e) | (np.isnan(a) & np.isnan(e))) if a.dtype.kind == "f" else (a == e)
    bad = select & ~same
    diff = np.zeros(e.shape, dtype=np.float64)
    if a.dtype.kind in "fiu":
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(a.astype(np.float64) - e.astype(np.float64))
        diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))  # NaN against NaN is no difference
    score = np.where(bad, np.where(diff > 0, diff, 1.0), -1.0)
    return _locate(comp, a, e, bad, score, diff, select, grid)


def compare_ulp(
    name: str,
    actual,
    expected,
    *,
    budget_ulp: float,
    mask=None,
    grid: TokenGrid | None = None,
    ulp_dtype: str | None = None,
    floor_fraction: float = FLOOR_FRACTION,
    reference_scale: float | None = None,
    rank: int | None = None,
    gradient: bool = False,
) -> UlpComparison:
    """``actual`` within ``budget_ulp`` ULPs of ``expected`` (the measure of the module docstring).

    ``ulp_dtype``: the dtype whose ULP is the unit (default: ``actual``'s); ``mask``, ``grid``, ``rank``,
    ``gradient`` as for ``compare_exact``; ``floor_fraction``, ``reference_scale``: see the module docstring."""
    a, e = _as_numpy(actual), _as_numpy(expected)
    dtype = str(a.dtype)
    comp = UlpComparison(
        name=name,
        dtype=dtype,
        shape=tuple(e.shape),
        rank=rank,
        gradient=gradient,
        budget_ulp=budget_ulp,
        ulp_dtype=ulp_dtype or dtype,
        floor_fraction=floor_fraction,
    )
    if a.shape != e.shape:
        comp.problem = f"shape {list(a.shape)} but expected {list(e.shape)}"
        return comp
    select = _selection(e, mask)
    comp.compared = int(select.sum())
    if comp.compared == 0:
        return comp
    e64 = e.astype(np.float64)
    scale = float(np.max(np.abs(np.where(select, e64, 0.0))))
    if reference_scale is not None:
        scale = max(scale, float(reference_scale))
    comp.scale = scale
    floor = max(scale * floor_fraction, np.finfo(np.float64).tiny)
    diff = np.abs(a.astype(np.float64) - e64)
    ulp = np.where(select, ulp_errors(a, e, eps_of(ulp_dtype or dtype), np.maximum(np.abs(e64), floor)), 0.0)
    bad = select & (ulp > budget_ulp)
    comp.max_ulp = float(np.max(ulp))
    comp.ulp_values = ulp
    comp.element_values = (a, e)
    score = np.where(select, ulp, -1.0)
    return _locate(comp, a, e, bad, score, diff, select, grid)


def error_map(actual, expected, mask=None) -> np.ndarray:
    """Per (row, global position) error: ``max |actual - expected|`` over trailing dims, ``[batch, sequence]`` float64."""
    a, e = _as_numpy(actual).astype(np.float64), _as_numpy(expected).astype(np.float64)
    diff = np.abs(a - e)
    diff = np.where(np.isnan(diff), np.inf, diff)
    if diff.ndim > 2:
        diff = diff.reshape(diff.shape[0], diff.shape[1], -1).max(axis=-1)
    if mask is not None:
        diff = np.where(_as_numpy(mask).astype(bool), diff, 0.0)
    return diff
