"""The model-owned context-parallel sharder.

``ContextParallelSharder`` mirrors the framework's class of the same name: it
holds a ``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None,
padding_token_id=0) -> (ctx_factory, local_batch, ShardLayout)`` strategy and
a ``local_token_global_indices(cp_mesh, padded_seq_len, device)`` index map.
The ``prepare_cp_inputs`` hooks of :mod:`cp_impl.inkling2` and
:mod:`cp_impl.mistral_large4` return one *unbound*; ``bind(cp_mesh)`` is the
one documented way to attach it to a CP mesh::

    sharder = prepare_cp_inputs(batch)["cp_sharder"].bind(cp_mesh)
    ctx_factory, local_batch = sharder.shard(batch)
    with ctx_factory():
        ...

Sharding is contiguous: the global sequence ``S`` is right-padded to
``S_pad = ceil(S / N) * N`` and rank ``r`` owns global positions
``[r * L, (r + 1) * L)`` with ``L = S_pad / N``.  Sharding runs no collective
(every rank holds the same global batch); ``gather_token_tensor`` does.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping

import torch

from . import _transport
from ._mesh import CPMesh, resolve_mesh

__all__ = ["ContextParallelSharder", "ShardLayout", "contiguous_local_token_global_indices"]

CtxFactory = Callable[[], ContextManager[Any]]


@dataclass(frozen=True)
class ShardLayout:
    """How one rank's local batch was cut from the global batch.

    - ``original_seq_len``: global sequence length ``S`` before divisibility padding.
    - ``padded_seq_len``: ``S_pad = ceil(S / cp_size) * cp_size``.
    - ``local_seq_len``: ``L = S_pad / cp_size``; this rank owns ``[cp_rank*L, (cp_rank+1)*L)``.
    - ``cp_size``, ``cp_rank``: ``N`` and ``r`` of the CP mesh (1 and 0 without one).
    - ``batch_size``: ``B`` (rows), ``num_chunks``: pipeline micro-batches along ``B``.
    - ``sharded_keys``: keys of the local batch that hold local ``[B, L, ...]`` slices.
    - ``global_keys``: keys passed through as the same global objects.
    """

    original_seq_len: int
    padded_seq_len: int
    local_seq_len: int
    cp_size: int
    cp_rank: int
    batch_size: int
    num_chunks: int
    sharded_keys: tuple[str, ...]
    global_keys: tuple[str, ...]


def _padded_len(seq_len: int, cp_size: int) -> int:
    return -(-seq_len // cp_size) * cp_size


def contiguous_local_token_global_indices(cp_mesh: Any, padded_seq_len: int, device: torch.device | str | None) -> torch.Tensor:
    """Global token index of each local token: LongTensor ``[L] = arange(r*L, (r+1)*L)``.

    ``padded_seq_len`` must be a non-negative int divisible by the CP size
    (``ValueError`` otherwise); ``cp_mesh`` ``None`` means one rank.
    """
    cp = resolve_mesh(cp_mesh, "cp_mesh")
    if not isinstance(padded_seq_len, int) or isinstance(padded_seq_len, bool) or padded_seq_len < 0:
        raise TypeError(f"padded_seq_len: expected a non-negative int, got {padded_seq_len!r}")
    if padded_seq_len % cp.size:
        raise ValueError(
            f"padded_seq_len={padded_seq_len} is not divisible by the CP size {cp.size}; pass "
            f"{_padded_len(padded_seq_len, cp.size)} (the sequence padded to a multiple of the CP size)"
        )
    local = padded_seq_len // cp.size
    return torch.arange(cp.rank * local, (cp.rank + 1) * local, dtype=torch.int64, device=device)


# ------------------------------------------------------- token slicing


def _pad_block(tensor: torch.Tensor, seq_dim: int, start: int, count: int, pad_value: Any, continue_count: bool) -> torch.Tensor:
    """Divisibility padding for global slots ``[start, start + count)`` (``start >= S``)."""
    if continue_count:
        seq_len = tensor.shape[seq_dim]
        last = tensor.narrow(seq_dim, seq_len - 1, 1)
        steps = torch.arange(start - seq_len + 1, start - seq_len + 1 + count, dtype=tensor.dtype, device=tensor.device)
        view = [1] * tensor.dim()
        view[seq_dim] = count
        return last + steps.view(view)
    shape = list(tensor.shape)
    shape[seq_dim] = count
    return torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device)


def shard_tokens(
    tensor: torch.Tensor,
    cp: CPMesh,
    seq_dim: int = 1,
    pad_value: Any = 0,
    *,
    continue_count: bool = False,
) -> torch.Tensor:
    """This rank's contiguous slice of the global token tensor (new, differentiable).

    The sequence (``tensor.shape[seq_dim] = S``) is padded to ``S_pad`` with
    ``pad_value`` (``continue_count``: last value + 1, + 2, ... along the
    sequence, for positions); only the padding this rank owns is materialised.
    """
    seq_len = tensor.shape[seq_dim]
    local = _padded_len(seq_len, cp.size) // cp.size
    lo, hi = cp.rank * local, (cp.rank + 1) * local
    # The real piece is kept even when empty, so that a slice of pure padding
    # still takes part in autograd like every other rank's slice.
    start_real = min(lo, seq_len)
    pieces = [tensor.narrow(seq_dim, start_real, min(hi, seq_len) - start_real)]
    if hi > max(lo, seq_len):
        start = max(lo, seq_len)
        pieces.append(_pad_block(tensor, seq_dim, start, hi - start, pad_value, continue_count))
    if len(pieces) == 1:
        return pieces[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(pieces, seq_dim)


@dataclass(frozen=True)
class TokenKey:
    """How one key of the batch is sharded: padding value or continued counting."""

    pad_value: Any = 0
    continue_count: bool = False


def shard_batch_tokens(
    cp_mesh: Any,
    batch: Mapping[str, Any],
    plan: Mapping[str, TokenKey],
    *,
    seq_len: int,
    batch_size: int,
    num_chunks: int,
    drop: tuple[str, ...] = (),
    replace: Mapping[str, torch.Tensor] | None = None,
) -> tuple[CtxFactory, dict[str, Any], ShardLayout]:
    """Shared body of the ``shard_batch`` strategies (inputs already validated).

    Returns a NEW dict: keys in ``plan`` become local slices (``replace``
    supplies a substitute global tensor for a key, e.g. masked labels), keys
    in ``drop`` are left out, every other key is the same global object.
    """
    cp = resolve_mesh(cp_mesh, "cp_mesh")
    replace = dict(replace or {})
    local: dict[str, Any] = {}
    sharded, passed = [], []
    for key, value in batch.items():
        if key in drop:
            continue
        if key in plan and value is not None:
            spec = plan[key]
            local[key] = shard_tokens(replace.get(key, value), cp, 1, spec.pad_value, continue_count=spec.continue_count)
            sharded.append(key)
        else:
            local[key] = value
            passed.append(key)
    for key, value in replace.items():  # extra token tensors that are not batch keys (loss_mask)
        if key not in batch and key in plan:
            local[key] = shard_tokens(value, cp, 1, plan[key].pad_value, continue_count=plan[key].continue_count)
            sharded.append(key)
    padded = _padded_len(seq_len, cp.size)
    layout = ShardLayout(
        original_seq_len=seq_len,
        padded_seq_len=padded,
        local_seq_len=padded // cp.size,
        cp_size=cp.size,
        cp_rank=cp.rank,
        batch_size=batch_size,
        num_chunks=num_chunks,
        sharded_keys=tuple(sharded),
        global_keys=tuple(passed),
    )
    return contextlib.nullcontext, local, layout


# ---------------------------------------------------------------- class

_NOT_BOUND = object()


class ContextParallelSharder:
    """Model-owned CP sharder: a ``shard_batch`` strategy plus its index map.

    Constructed by the ``prepare_cp_inputs`` hooks (unbound).  Attributes:

    - ``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0)
      -> (ctx_factory, local_batch, ShardLayout)``: the strategy.
    - ``local_token_global_indices(cp_mesh, padded_seq_len, device) -> LongTensor [L]``:
      global index of each local token (contiguous).
    - ``padding_token_id``: ``input_ids`` value of divisibility padding.
    - ``cp_mesh``, ``tp_mesh``: set by :meth:`bind`; ``shard_layout``: set by :meth:`shard`.

    ``ctx_factory`` is a zero-argument callable returning a context manager
    (``contextlib.nullcontext``: the model itself owns CP, nothing is patched).
    """

    def __init__(
        self,
        shard_batch: Callable[..., tuple[CtxFactory, dict[str, Any], ShardLayout]],
        local_token_global_indices: Callable[[Any, int, Any], torch.Tensor] = contiguous_local_token_global_indices,
        *,
        padding_token_id: int = 0,
    ) -> None:
        if not callable(shard_batch) or not callable(local_token_global_indices):
            raise TypeError("ContextParallelSharder: shard_batch and local_token_global_indices must be callables")
        self.shard_batch = shard_batch
        self.local_token_global_indices = local_token_global_indices
        self.padding_token_id = padding_token_id
        self.cp_mesh: Any = _NOT_BOUND
        self.tp_mesh: Any = None
        self.shard_layout: ShardLayout | None = None

    @property
    def is_bound(self) -> bool:
        """True once :meth:`bind` produced this sharder."""
        return self.cp_mesh is not _NOT_BOUND

    def __repr__(self) -> str:
        mesh = "unbound" if not self.is_bound else f"cp_mesh={self.cp_mesh!r}"
        return f"ContextParallelSharder({mesh}, shard_layout={self.shard_layout!r})"

    def bind(self, cp_mesh: Any, tp_mesh: Any = None) -> "ContextParallelSharder":
        """Return a copy bound to ``cp_mesh`` (1-D ``DeviceMesh``; ``None`` = one rank).

        ``tp_mesh`` is recorded and handed to the strategy (unused by these
        models).  ``ValueError``/``TypeError`` naming ``cp_mesh`` for a mesh
        that is not one-dimensional.  The receiver is left unchanged.
        """
        resolve_mesh(cp_mesh, "cp_mesh")
        bound = copy.copy(self)
        bound.cp_mesh, bound.tp_mesh, bound.shard_layout = cp_mesh, tp_mesh, None
        return bound

    def _mesh(self, what: str) -> CPMesh:
        if not self.is_bound:
            raise RuntimeError(
                f"ContextParallelSharder.{what}: the sharder is not bound to a CP mesh; call "
                f"sharder = sharder.bind(cp_mesh) first (cp_mesh=None for a single rank)"
            )
        return resolve_mesh(self.cp_mesh, "cp_mesh")

    def shard(self, batch: Mapping[str, Any], *, loss_mask: torch.Tensor | None = None) -> tuple[CtxFactory, dict[str, Any]]:
        """Shard the prepared global ``batch``: returns ``(ctx_factory, local_batch)``.

        ``local_batch`` is a new dict (``batch`` is not modified); which keys
        are local ``[B, L]`` and which stay global is up to the strategy and
        recorded in ``self.shard_layout`` (a :class:`ShardLayout`).  An
        optional global ``loss_mask [B, S]`` is sharded into
        ``local_batch["loss_mask"]``.  ``RuntimeError`` when unbound.
        """
        self._mesh("shard")
        ctx_factory, local, layout = self.shard_batch(
            self.cp_mesh, self.tp_mesh, batch, loss_mask=loss_mask, padding_token_id=self.padding_token_id
        )
        self.shard_layout = layout
        return ctx_factory, local

    def _seq_dim(self, tensor: Any, seq_dim: Any, what: str) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ContextParallelSharder.{what}: tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or not -tensor.dim() <= seq_dim < tensor.dim():
            raise ValueError(f"ContextParallelSharder.{what}: seq_dim={seq_dim!r} is not a dimension of a {tensor.dim()}-D tensor")
        return seq_dim % tensor.dim()

    def shard_token_tensor(self, tensor: torch.Tensor, *, seq_dim: int = 1, pad_value: Any = 0) -> torch.Tensor:
        """This rank's local slice of a token-aligned global tensor.

        ``tensor`` is global along ``seq_dim`` (length ``S``; after
        :meth:`shard` it must be the recorded original or padded length); it is
        padded to ``S_pad`` with ``pad_value`` and sliced to ``[r*L, (r+1)*L)``.
        The result is a new tensor, differentiable with respect to ``tensor``.
        No collective runs.
        """
        cp = self._mesh("shard_token_tensor")
        dim = self._seq_dim(tensor, seq_dim, "shard_token_tensor")
        layout = self.shard_layout
        if layout is not None and tensor.shape[dim] not in (layout.original_seq_len, layout.padded_seq_len):
            raise ValueError(
                f"ContextParallelSharder.shard_token_tensor: tensor has {tensor.shape[dim]} tokens along seq_dim={seq_dim}, "
                f"but the sharded batch has {layout.original_seq_len} (padded {layout.padded_seq_len}); pass a global tensor"
            )
        return shard_tokens(tensor, cp, dim, pad_value)

    def gather_token_tensor(self, tensor: torch.Tensor, *, seq_dim: int = 1) -> torch.Tensor:
        """Restore a global ``[.., S_original, ..]`` tensor from every rank's local slice.

        ``tensor`` is this rank's ``[.., L, ..]`` slice (``L`` from
        ``shard_layout``); the slices are all-gathered in rank order (one
        all-gather forward, one reduce-scatter of the gradient backward) and
        the divisibility padding is dropped.  ``RuntimeError`` before
        :meth:`shard`; ``ValueError`` on every rank when ranks pass different
        shapes or a length other than ``L``.
        """
        cp = self._mesh("gather_token_tensor")
        layout = self.shard_layout
        if layout is None:
            raise RuntimeError(
                "ContextParallelSharder.gather_token_tensor: no shard layout recorded; call shard(batch) first "
                "so that the sharder knows the original sequence length"
            )
        api = "ContextParallelSharder.gather_token_tensor"
        if not cp.single:
            is_tensor = isinstance(tensor, torch.Tensor)
            needs_grad = torch.is_grad_enabled() and is_tensor and tensor.requires_grad
            same_dim = seq_dim % tensor.dim() if is_tensor and isinstance(seq_dim, int) and tensor.dim() else seq_dim
            _transport.agree(cp, api, {"tensor": tensor}, flags={"requires_grad": needs_grad}, extra=("seq_dim", same_dim))
        dim = self._seq_dim(tensor, seq_dim, "gather_token_tensor")
        if tensor.shape[dim] != layout.local_seq_len:
            raise ValueError(
                f"{api}: tensor has {tensor.shape[dim]} tokens along seq_dim={seq_dim}; pass this rank's local slice "
                f"of {layout.local_seq_len} tokens"
            )
        full = tensor if cp.single else _transport.gather_along(tensor, cp, dim, differentiable=True)
        return full.narrow(dim, 0, layout.original_seq_len)
