"""What every check shares about token layouts: rank outputs put back in global order, and the layout
the ranks reported judged against the contract (``judge_token_layout``).

Shapes: local token tensors are ``[batch, local_len, ...]`` on each rank; index maps ``[local_len]``
list the global position of every local token (``token_indices``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_harness.judging.compare import TokenGrid, compare_exact
from cp_harness.judging.verdicts import CaseReport


def stack_ranks(outputs: list, name: str, axis: int = 1) -> np.ndarray:
    """Concatenate a local token tensor from every rank in rank order along ``axis`` (global order)."""
    missing = [o.rank for o in outputs if name not in o.tensors]
    if missing:
        raise KeyError(f"ranks {missing} returned no tensor {name!r}")
    return np.concatenate([o.tensors[name] for o in outputs], axis=axis)


class NotShardedLikeTokens(ValueError):
    """A local tensor whose sequence axis does not hold the tokens of its rank's index map: a finding about the
    sharder (``checks.evaluate`` turns it into the case's problem), never a crash of the judge."""


@dataclasses.dataclass
class ReportedLayout:
    """The layout the ranks reported, once judged consistent: ``S`` real and ``S_pad`` padded positions,
    each rank's index map ``[L]`` (rank order) and the grid for failure messages."""

    seq_len: int
    padded_len: int
    index_maps: list[np.ndarray]
    grid: TokenGrid

    @property
    def local_len(self) -> int:
        return len(self.index_maps[0]) if self.index_maps else 0

    def scatter(self, outputs: list, name: str, axis: int = 1) -> np.ndarray:
        """A local token tensor from every rank put at its global positions: ``[.., S_pad, ..]`` in global order."""
        missing = [o.rank for o in outputs if name not in o.tensors]
        if missing:
            raise KeyError(f"ranks {missing} returned no tensor {name!r}")
        first = np.asarray(outputs[0].tensors[name])
        shape = list(first.shape)
        shape[axis] = self.padded_len
        out = np.zeros(shape, dtype=first.dtype)
        for o, indices in zip(outputs, self.index_maps):
            local = np.asarray(o.tensors[name])
            if local.ndim <= axis or local.shape[axis] != len(indices):
                held = local.shape[axis] if local.ndim > axis else "no"
                raise NotShardedLikeTokens(
                    f"rank {o.rank}: local {name} holds {held} positions along its sequence axis, but the rank's index "
                    f"map lists {len(indices)} tokens: {name} is not sharded like the tokens "
                    f"(global length {self.seq_len}, padded {self.padded_len})"
                )
            where: list[slice | np.ndarray] = [slice(None)] * len(shape)
            where[axis] = indices
            out[tuple(where)] = local
        return out


def reported_layout(outputs: list, seq_len: int) -> ReportedLayout:
    """The layout the ranks reported (``token_indices``), taken as it is (``judge_token_layout`` judges it)."""
    maps = [np.asarray(o.tensors["token_indices"]).reshape(-1).astype(np.int64) for o in outputs]
    return ReportedLayout(seq_len, sum(len(m) for m in maps), maps, TokenGrid.from_index_maps(maps, seq_len))


def judge_token_layout(report: CaseReport, outputs: list, seq_len: int, *, local_name: str) -> ReportedLayout | None:
    """Judge the layout every rank reported (``sharding.layout_report``) against the contract; ``None`` when
    it is not usable (the problems are in ``report``).

    - every rank's index map has as many tokens as its local tensor ``local_name`` (axis 1), all ranks equally many;
    - together they own every position of ``[0, N*L)`` exactly once, and ``N*L >= S``;
    - the reported ``original_seq_len`` / ``padded_seq_len`` (when given) are ``S`` and ``N*L``;
    - ``shard_token_tensor`` of the global ``arange(S)`` (fill ``-1``) selects exactly the index map's tokens.
    """
    maps = [np.asarray(o.tensors["token_indices"]).reshape(-1).astype(np.int64) for o in outputs]
    usable = True
    for o, indices in zip(outputs, maps):
        local_len = np.asarray(o.tensors[local_name]).shape[1]
        if len(indices) != local_len:
            report.problem(
                f"rank {o.rank}: the index map lists {len(indices)} tokens but its local {local_name} holds {local_len}"
            )
            usable = False
    lengths = {len(m) for m in maps}
    if len(lengths) > 1:
        report.problem(f"ranks own different numbers of tokens: {[len(m) for m in maps]} (the verbs need equal shards)")
        usable = False
    padded = sum(len(m) for m in maps)
    if usable:
        owned = np.concatenate(maps) if maps else np.zeros(0, dtype=np.int64)
        counts = np.bincount(owned[(owned >= 0) & (owned < padded)], minlength=padded)
        outside = owned[(owned < 0) | (owned >= padded)]
        if outside.size or (counts != 1).any():
            twice = np.flatnonzero(counts > 1)[:5].tolist()
            nobody = np.flatnonzero(counts == 0)[:5].tolist()
            report.problem(
                f"the index maps do not own every global position of [0, {padded}) exactly once: "
                f"owned twice {twice}, by nobody {nobody}, outside {outside[:5].tolist()}"
            )
            usable = False
    if padded < seq_len:
        report.problem(f"the ranks hold {padded} tokens in all, fewer than the sequence's {seq_len}")
        usable = False
    for o in outputs:
        original, reported = o.info.get("original_seq_len"), o.info.get("padded_seq_len")
        if original is not None and original != seq_len:
            report.problem(f"rank {o.rank}: shard_layout.original_seq_len={original}, the batch has {seq_len}")
        if reported is not None and reported != padded:
            report.problem(f"rank {o.rank}: shard_layout.padded_seq_len={reported}, but the ranks hold {padded}")
    if not usable:
        return None
    layout = reported_layout(outputs, seq_len)
    for o, indices in zip(outputs, maps):
        marker, expected = np.asarray(o.tensors["token_marker"]), np.where(indices < seq_len, indices, -1)
        comp = report.add(
            compare_exact(
                f"shard_token_tensor(arange(S)) agrees with the index map@rank{o.rank}", marker, expected, rank=o.rank
            )
        )
        if not comp.ok and marker.shape == expected.shape and np.array_equal(np.sort(marker), np.sort(expected)):
            report.problem(
                f"rank {o.rank}: the local tensors hold the tokens of its index map in another "
                f"order (shard_token_tensor gives {marker.tolist()[:12]}, the index map reports "
                f"{expected.tolist()[:12]}): the sharder reports one layout and cuts another"
            )
    return layout
