"""One comparison routine for properties, golden files and the verify command.

Two modes:

- ``exact``: pure data movement (gathers, halos, sharding, layout). Every
  element must be bit-identical (``-0.0`` equals ``0.0``; NaN equals NaN only
  when both are NaN at the same place).
- ``ulp``: arithmetic. The error of an element is measured in units in the
  last place of the compared dtype, relative to ``max(|expected|, floor)``
  where ``floor = floor_fraction * max|expected|`` over the tensor:
  ``ulp = |actual - expected| / (eps(dtype) * max(|expected|, floor))``.
  With the default ``floor_fraction = 1/1024`` each element is judged nearly
  on its own (near-zero elements produced by cancellation against 1/1024 of
  the tensor's scale); ``floor_fraction = 1`` is the normwise measure (every
  element against the tensor's largest magnitude).

  ``reference_scale`` widens "the tensor's largest magnitude" to a family of
  tensors (``max(own, reference_scale)``): parameter gradients are judged
  against the largest gradient of the model, because a gradient that is
  mathematically zero (a one-key softmax row, identical values) is computed
  as rounding noise of the terms that formed it, and has no scale of its own.

``ulp_dtype`` may be ``"bfloat16"`` or ``"float16"`` too (``cases.EPS``); bfloat16
tensors arrive widened to float32, which is exact, so ``exact`` still means bit for bit.

Beside its ULP budget, an arithmetic comparison of a multi-rank case can carry
the *excess* verdict of ``cp_harness.judging.excess``: the same tensor computed by
the same implementation on one rank (the baseline) has its own error against
the oracle, and CP may add at most ``c`` times that error plus a floor
(``TensorComparison.baseline_ulp``, ``excess``, ``excess_limit``). The
per-element values and errors are kept for that judge and for the error map
of an excess failure, which shows where CP added error over one device.

A ``TensorComparison`` records how many elements were compared, how many
exceed the budget, the largest error and where it is. When the tensor is
token-aligned (``[batch, sequence, ...]`` in global order) the location also
names the owning CP rank and the distance to the nearest shard boundary, so a
boundary bug reads as one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from cp_harness.cases.descriptions import EPS

FLOOR_FRACTION = 1.0 / 1024.0


def eps_of(dtype_name: str) -> float:
    """Machine epsilon of a dtype name (``"bfloat16"`` included, which numpy does not know)."""
    if dtype_name in EPS:
        return EPS[dtype_name]
    return float(np.finfo(np.dtype(dtype_name)).eps)


def describe_location(loc: dict[str, Any]) -> str:
    """``row r, global position p, owned by rank k, ...`` of a ``TokenGrid.describe`` entry: how far the nearest
    shard boundary is (only where the layout has one: a boundary can explain the defect only there), and
    whether the position is divisibility padding."""
    parts = [f"row {loc['row']}", f"global position {loc['position']}", f"owned by rank {loc['owning_rank']}"]
    if loc.get("divisibility_padding"):
        parts.append("divisibility padding")
    distance = loc.get("distance_to_shard_boundary")
    if distance is not None:
        parts.append(f"{distance} tokens from a shard boundary" + (", AT A SHARD BOUNDARY" if distance == 0 else ""))
    return ", ".join(parts)


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
    def from_index_maps(cls, index_maps: list, seq_len: int | None = None) -> "TokenGrid":
        """The grid of a layout given each rank's ``local_token_global_indices`` (rank order)."""
        local_len = len(index_maps[0]) if index_maps else 0
        total = sum(len(m) for m in index_maps)
        owners = [0] * total
        for rank, indices in enumerate(index_maps):
            for g in np.asarray(indices).reshape(-1).tolist():
                if 0 <= g < total:
                    owners[g] = rank
        return cls(local_len, len(index_maps), tuple(owners), seq_len)

    def sliced(self, start: int) -> "TokenGrid":
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
        return {"row": row, "position": position, "owning_rank": owner, "distance_to_shard_boundary": distance,
                "at_shard_boundary": distance == 0,
                "divisibility_padding": self.seq_len is not None and position >= self.seq_len}


@dataclasses.dataclass
class TensorComparison:
    """Outcome of comparing one named tensor. ``ok`` is False when any element fails, shapes differ, or nothing was compared."""

    name: str
    mode: str
    dtype: str
    shape: tuple[int, ...]
    compared: int
    mismatched: int
    max_ulp: float
    max_abs: float
    budget_ulp: float | None
    worst_index: tuple[int, ...] | None = None
    worst_actual: float | None = None
    worst_expected: float | None = None
    location: dict[str, Any] | None = None
    problem: str | None = None
    first_mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # For failing token-aligned tensors: max error per (row, global position), and the shard grid.
    error_map: np.ndarray | None = dataclasses.field(default=None, repr=False)
    grid: TokenGrid | None = None
    # ulp mode: the error of every element in ULPs (0 where not selected), for the excess judge.
    ulp_values: np.ndarray | None = dataclasses.field(default=None, repr=False)
    element_values: tuple | None = dataclasses.field(default=None, repr=False)  # (actual, expected) arrays
    ulp_dtype: str | None = None
    floor_fraction: float | None = None
    scale: float | None = None  # ulp mode: the tensor's scale (largest expected magnitude, or reference_scale)
    # The excess judge (cp_harness.judging.excess): the one-rank baseline's largest error in the same measure,
    # the CP excess = max_ulp / (baseline_ulp + floor / limit), and the limit c it must not exceed.
    baseline_ulp: float | None = None
    excess_error: float | None = None  # the CP error in the judge's (normwise) measure
    excess: float | None = None
    excess_limit: float | None = None
    excess_floor: float | None = None
    excess_mismatched: int = 0
    error_map_unit: str | None = None

    @property
    def excess_failed(self) -> bool:
        return self.excess is not None and self.excess_limit is not None and not self.excess <= self.excess_limit

    @property
    def ok(self) -> bool:
        return self.problem is None and self.mismatched == 0 and self.compared > 0 and not self.excess_failed

    def summary(self) -> str:
        if self.problem is not None:
            return f"{self.name}: {self.problem}"
        if self.compared == 0:
            return f"{self.name}: nothing was compared (empty selection): a vacuous comparison is a failure"
        head = (f"{self.name} [{self.mode}, {self.dtype}, shape {list(self.shape)}]: "
                f"{self.mismatched} of {self.compared} elements differ")
        if self.mode == "ulp":
            unit = f"{self.ulp_dtype} ULP" if self.ulp_dtype and self.ulp_dtype != self.dtype else "ULP"
            budget = (f"budget {self.budget_ulp:g} ULP" if math.isfinite(self.budget_ulp)
                      else "no ULP budget: judged by its excess over one rank")
            head += f"; largest error {self.max_ulp:.3g} {unit} ({budget}), {self.max_abs:.3g} absolute"
            if self.excess is not None:
                head += (f"; normwise: CP error {self.excess_error:.3g} {unit}, one-rank error {self.baseline_ulp:.3g}, "
                         f"CP excess {self.excess:.3g} (limit {self.excess_limit:g}: CP error <= {self.excess_limit:g}"
                         f" x one-rank error + {self.excess_floor:g} ULP)")
                if self.excess_failed:
                    head += (f"; CP ADDS ERROR: {self.excess_mismatched} elements above "
                             f"{self.excess_limit:g} x {self.baseline_ulp:.3g} ULP + the floor")
        elif self.mismatched:
            head += f"; largest absolute difference {self.max_abs:.6g}"
        if (self.mismatched or self.excess_failed) and self.worst_index is not None:
            head += f"; worst at index {list(self.worst_index)}: actual {self.worst_actual!r}, expected {self.worst_expected!r}"
            if self.location:
                head += f" ({describe_location(self.location)})"
        return head

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("error_map", None)
        data.pop("ulp_values", None)
        data.pop("element_values", None)
        data.pop("scale", None)
        data["ok"] = self.ok
        data["shape"] = list(self.shape)
        data["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
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


def compare(name: str, actual, expected, *, mode: str, budget_ulp: float | None = None,
            mask=None, grid: TokenGrid | None = None, ulp_dtype: str | None = None,
            floor_fraction: float = FLOOR_FRACTION, reference_scale: float | None = None) -> TensorComparison:
    """Compare ``actual`` with ``expected``.

    ``mode``: ``"exact"`` or ``"ulp"`` (then ``budget_ulp`` is required).
    ``mask``: optional bool array broadcastable to the leading dims of the
    tensors; only selected elements are compared (an empty selection fails).
    ``grid``: when the tensor is ``[batch, sequence, ...]`` in global token
    order, used to name the owning rank and boundary distance of the worst element.
    ``ulp_dtype``: the dtype whose ULP is the unit (default: ``actual``'s).
    ``floor_fraction``, ``reference_scale``: see the module docstring.
    """
    if mode not in ("exact", "ulp"):
        raise ValueError(f"mode={mode!r}; pass 'exact' for data movement or 'ulp' for arithmetic")
    if mode == "ulp" and budget_ulp is None:
        raise ValueError("mode='ulp' needs budget_ulp (the allowed error in units in the last place)")
    a, e = _as_numpy(actual), _as_numpy(expected)
    dtype = str(a.dtype)
    base = TensorComparison(name=name, mode=mode, dtype=dtype, shape=tuple(e.shape), compared=0, mismatched=0,
                            max_ulp=0.0, max_abs=0.0, budget_ulp=budget_ulp,
                            ulp_dtype=(ulp_dtype or dtype) if mode == "ulp" else None,
                            floor_fraction=floor_fraction if mode == "ulp" else None)
    if a.shape != e.shape:
        base.problem = f"shape {list(a.shape)} but expected {list(e.shape)}"
        return base
    if mode == "exact" and a.dtype != e.dtype:
        base.problem = f"dtype {a.dtype} but expected {e.dtype} (data movement must preserve dtype)"
        return base
    if mask is None:
        select = np.ones(e.shape, dtype=bool)
    else:
        m = _as_numpy(mask).astype(bool)
        select = np.broadcast_to(m.reshape(m.shape + (1,) * (e.ndim - m.ndim)), e.shape)
    base.compared = int(select.sum())
    if base.compared == 0:
        return base

    if mode == "exact":
        if a.dtype.kind == "f":
            same = (a == e) | (np.isnan(a) & np.isnan(e))
        else:
            same = a == e
        bad = select & ~same
        diff = np.zeros(e.shape, dtype=np.float64)
        if a.dtype.kind in "fiu":
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.abs(a.astype(np.float64) - e.astype(np.float64))
            diff = np.where(np.isnan(diff), np.inf, diff)
        score = np.where(bad, np.where(diff > 0, diff, 1.0), -1.0)
    else:
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        eps = eps_of(ulp_dtype or str(a.dtype))
        scale = float(np.max(np.abs(np.where(select, e64, 0.0)))) if base.compared else 0.0
        if reference_scale is not None:
            scale = max(scale, float(reference_scale))
        base.scale = scale
        floor = max(scale * floor_fraction, np.finfo(np.float64).tiny)
        diff = np.abs(a64 - e64)
        ulp = diff / (eps * np.maximum(np.abs(e64), floor))
        ulp = np.where(np.isnan(ulp) | (np.isnan(a64) != np.isnan(e64)), np.inf, ulp)
        ulp = np.where(np.isnan(a64) & np.isnan(e64), 0.0, ulp)
        ulp = np.where(select, ulp, 0.0)
        bad = select & (ulp > budget_ulp)
        base.max_ulp = float(np.max(ulp))
        base.ulp_values = ulp
        base.element_values = (a, e)
        score = np.where(select, ulp, -1.0)
    base.mismatched = int(bad.sum())
    base.max_abs = float(np.max(np.where(select, diff, 0.0))) if diff.size else 0.0
    if base.max_abs != base.max_abs:  # NaN
        base.max_abs = math.inf
    worst = np.unravel_index(int(np.argmax(score)), e.shape) if e.size else None
    if worst is not None:
        base.worst_index = tuple(int(i) for i in worst)
        base.worst_actual = _float(a[worst])
        base.worst_expected = _float(e[worst])
        if grid is not None and e.ndim >= 2:
            base.location = grid.describe(int(worst[0]), int(worst[1]))
    if grid is not None and e.ndim >= 2:
        base.grid = grid
    if base.mismatched and grid is not None and grid.start == 0 and e.ndim >= 2:  # a picture of whole rows only
        per_element = np.where(bad, np.where(np.isfinite(score), np.maximum(score, 0.0), np.inf), 0.0)
        if per_element.ndim > 2:
            per_element = per_element.reshape(per_element.shape[0], per_element.shape[1], -1).max(axis=-1)
        base.error_map = per_element
    if base.mismatched:
        for idx in np.argwhere(bad)[:5]:
            idx = tuple(int(i) for i in idx)
            entry = {"index": list(idx), "actual": _float(a[idx]), "expected": _float(e[idx])}
            if grid is not None and e.ndim >= 2:
                entry.update(grid.describe(idx[0], idx[1]))
            base.first_mismatches.append(entry)
    return base


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
