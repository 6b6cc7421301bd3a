"""The model-owned context-parallel sharder: a dependency-free mirror of the framework's class.

``ContextParallelSharder`` follows the published contract of
``nemo_automodel.components.distributed.context_parallel.sharder`` (0.7.0)
without importing it:

- a model hook returns it *unresolved*:
  ``ContextParallelSharder(shard_batch=..., local_token_global_indices=...)``;
- the framework resolves it for a step with a device mesh that has a ``"cp"``
  dimension: ``ContextParallelSharder(device_mesh=mesh, shard_batch=...,
  local_token_global_indices=..., padding_token_id=..., loss_mask=...)``;
- ``shard(batch) -> (ctx_factory, local_batch)`` runs ``shard_batch(cp_mesh,
  tp_mesh, batch, *, loss_mask=None, padding_token_id=0) -> (ctx_factory,
  local_batch, ShardLayout)`` and records the layout as ``shard_layout``;
- ``local_token_global_indices(cp_mesh, padded_seq_len, device) -> LongTensor
  [L]``, the global position of every local token, is the one coordinate
  system every layout question is answered from;
- the verbs ``shard_token_tensor(tensor, seq_dim=1, fill=None)`` and
  ``gather_token_tensor(tensor, seq_dim=1, trim=False, fill=None)``.

Layouts (:data:`LAYOUTS`): the bundled hooks pad the sequence ``S`` to
``ceil(S / N) * N`` and shard contiguously (rank ``r`` owns
``[r*L, (r+1)*L)``); two more layouts exist to prove that a judge of this
contract takes the layout from what the sharder reports:
``contiguous_2n`` pads to a multiple of ``2N`` (as the framework's shared
``shard_batch_contiguous`` does with ``pad_multiple <= 2``), and
``load_balanced`` pads to a multiple of ``2N`` and gives rank ``r`` chunks
``r`` and ``2N-1-r`` of ``2N`` (torch ``context_parallel``'s head-tail
pairing). Sharding runs no collective (every rank holds the same global
batch); ``gather_token_tensor`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from . import _transport
from ._mesh import CPMesh, resolve_mesh

__all__ = [
    "LAYOUTS",
    "ContextParallelSharder",
    "ShardLayout",
    "TokenLayout",
    "contiguous_local_token_global_indices",
    "load_balanced_local_token_global_indices",
]

CtxFactory = Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True)
class ShardLayout:
    """What a ``shard_batch`` learned about the layout it applied (the framework's fields).

    - ``local_token_global_indices``: LongTensor ``[L]``, the partition actually
      computed, for data-dependent layouts; ``None`` when the index map is the
      closed-form function on the sharder (every layout of this package).
    - ``original_seq_len``: ``S`` before divisibility padding.
    - ``padded_seq_len``: ``S_pad`` after it (``N * L``).
    - ``input_row_shape``: for flat-stream (THD) layouts, the ``[B, S]`` shape of
      the rows before flattening (``None`` here: rows are never flattened).
    - ``input_token_stream_positions``: for layouts that move tokens, the
      ``[B, S_in]`` map from input position to padded column, ``-1`` for a
      dropped slot (``None`` here: tokens keep their column).
    """

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None


_NO_SHARD_LAYOUT = ShardLayout()


# ------------------------------------------------------------------ index maps


def _checked_padded_len(cp: CPMesh, padded_seq_len: Any, multiple: int) -> int:
    if not isinstance(padded_seq_len, int) or isinstance(padded_seq_len, bool) or padded_seq_len < 0:
        raise TypeError(f"padded_seq_len: expected a non-negative int, got {padded_seq_len!r}")
    if padded_seq_len % multiple:
        raise ValueError(
            f"padded_seq_len={padded_seq_len} is not divisible by {multiple} (CP size {cp.size}); pass "
            f"{-(-padded_seq_len // multiple) * multiple} (the sequence padded to a multiple of {multiple})"
        )
    return padded_seq_len


def contiguous_local_token_global_indices(
    cp_mesh: Any, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global token index of each local token: LongTensor ``[L] = arange(r*L, (r+1)*L)``, ``L = S_pad / N``.

    ``padded_seq_len`` must be a non-negative int divisible by the CP size
    (``ValueError`` otherwise); ``cp_mesh`` ``None`` means one rank.
    """
    cp = resolve_mesh(cp_mesh, "cp_mesh")
    local = _checked_padded_len(cp, padded_seq_len, cp.size) // cp.size
    return torch.arange(cp.rank * local, (cp.rank + 1) * local, dtype=torch.int64, device=device)


def load_balanced_local_token_global_indices(
    cp_mesh: Any, padded_seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Head-tail pairing: LongTensor ``[L]``, chunk ``r`` then chunk ``2N-1-r`` of ``2N`` chunks of ``S_pad / 2N``.

    ``padded_seq_len`` must be divisible by ``2N`` (``ValueError`` otherwise).
    """
    cp = resolve_mesh(cp_mesh, "cp_mesh")
    chunk = _checked_padded_len(cp, padded_seq_len, 2 * cp.size) // (2 * cp.size)
    head = torch.arange(cp.rank * chunk, (cp.rank + 1) * chunk, dtype=torch.int64, device=device)
    tail_start = (2 * cp.size - 1 - cp.rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, dtype=torch.int64, device=device)
    return torch.cat((head, tail))


@dataclass(frozen=True)
class TokenLayout:
    """A sharding layout: how far the sequence is padded and which global tokens each rank keeps.

    ``multiple(N)``: ``S`` is right-padded to a multiple of it;
    ``local_token_global_indices``: the index map (see the functions above).
    """

    name: str
    multiple: Callable[[int], int]
    local_token_global_indices: Callable[[Any, int, Any], torch.Tensor]

    def padded_len(self, seq_len: int, cp_size: int) -> int:
        m = self.multiple(cp_size)
        return -(-seq_len // m) * m


LAYOUTS: dict[str, TokenLayout] = {
    "contiguous": TokenLayout("contiguous", lambda n: n, contiguous_local_token_global_indices),
    "contiguous_2n": TokenLayout("contiguous_2n", lambda n: 2 * n, contiguous_local_token_global_indices),
    "load_balanced": TokenLayout("load_balanced", lambda n: 2 * n, load_balanced_local_token_global_indices),
}


# ------------------------------------------------------- token slicing


def _pad_block(tensor: torch.Tensor, seq_dim: int, count: int, pad_value: Any, continue_count: bool) -> torch.Tensor:
    """``count`` divisibility-padding slots after the ``S`` real ones: ``pad_value``, or last value + 1, + 2, ..."""
    if continue_count and tensor.shape[seq_dim] > 0:
        last = tensor.narrow(seq_dim, tensor.shape[seq_dim] - 1, 1)
        steps = torch.arange(1, count + 1, dtype=tensor.dtype, device=tensor.device)
        view = [1] * tensor.dim()
        view[seq_dim] = count
        return last + steps.view(view)
    shape = list(tensor.shape)
    shape[seq_dim] = count
    if continue_count:  # nothing to continue from: count from 0
        steps = torch.arange(count, dtype=tensor.dtype, device=tensor.device)
        view = [1] * tensor.dim()
        view[seq_dim] = count
        return steps.view(view).expand(shape).clone()
    return torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device)


def pad_tokens(
    tensor: torch.Tensor, padded_len: int, seq_dim: int = 1, pad_value: Any = 0, *, continue_count: bool = False
) -> torch.Tensor:
    """``tensor`` right-padded along ``seq_dim`` to ``padded_len`` (itself when nothing is missing)."""
    missing = padded_len - tensor.shape[seq_dim]
    if missing <= 0:
        return tensor
    return torch.cat((tensor, _pad_block(tensor, seq_dim, missing, pad_value, continue_count)), seq_dim)


def shard_tokens(
    tensor: torch.Tensor,
    cp_mesh: Any,
    layout: TokenLayout,
    seq_dim: int = 1,
    pad_value: Any = 0,
    *,
    continue_count: bool = False,
) -> torch.Tensor:
    """This rank's tokens of the global ``tensor`` (new, differentiable), in local order.

    The sequence (``tensor.shape[seq_dim] = S``) is padded to ``layout``'s
    ``S_pad`` with ``pad_value`` (``continue_count``: last value + 1, + 2, ...,
    for positions), then the layout's index map selects this rank's tokens.
    A rank that owns only padding still gets a slice connected to ``tensor``
    in autograd.
    """
    padded_len = layout.padded_len(tensor.shape[seq_dim], resolve_mesh(cp_mesh, "cp_mesh").size)
    full = pad_tokens(tensor, padded_len, seq_dim, pad_value, continue_count=continue_count)
    return full.index_select(seq_dim, layout.local_token_global_indices(cp_mesh, padded_len, tensor.device))


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
    layout: TokenLayout,
    seq_len: int,
    drop: tuple[str, ...] = (),
    replace: Mapping[str, torch.Tensor] | None = None,
) -> tuple[CtxFactory, dict[str, Any], ShardLayout]:
    """Shared body of the ``shard_batch`` strategies (inputs already validated).

    Returns a NEW dict: keys in ``plan`` become local slices (``replace``
    supplies a substitute global tensor for a key, e.g. masked labels), keys
    in ``drop`` are left out, every other key is the same global object.
    """
    size = resolve_mesh(cp_mesh, "cp_mesh").size
    replace = dict(replace or {})
    local: dict[str, Any] = {}
    for key, value in batch.items():
        if key in drop:
            continue
        if key in plan and value is not None:
            spec = plan[key]
            local[key] = shard_tokens(
                replace.get(key, value), cp_mesh, layout, 1, spec.pad_value, continue_count=spec.continue_count
            )
        else:
            local[key] = value
    for key, value in replace.items():  # extra token tensors that are not batch keys (loss_mask)
        if key not in batch and key in plan:
            local[key] = shard_tokens(
                value, cp_mesh, layout, 1, plan[key].pad_value, continue_count=plan[key].continue_count
            )
    shard_layout = ShardLayout(original_seq_len=seq_len, padded_seq_len=layout.padded_len(seq_len, size))
    return contextlib.nullcontext, local, shard_layout


# ---------------------------------------------------------------- class


class ContextParallelSharder:
    """How a batch is sharded and where local tokens live (the framework's contract).

    Attributes (as in the framework): ``shard_batch``, ``local_token_global_indices``,
    ``shard_layout`` (set by :meth:`shard`), ``_cp_mesh``, ``_tp_mesh``,
    ``_loss_mask``, ``_padding_token_id``.

    Constructed directly from ``shard_batch`` (a hook's unresolved sharder, or
    the framework's resolution with ``device_mesh``). The framework's other
    form, resolving a *model*'s strategy from ``model``/``batch``, needs the
    framework's model dispatch and is not available here: it raises
    ``NotImplementedError`` after the same argument checks.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        device_mesh: Any = None,
        batch: dict[str, Any] | None = None,
        *,
        shard_batch: Callable[..., tuple[CtxFactory, dict[str, Any], ShardLayout | None]] | None = None,
        local_token_global_indices: Callable[..., torch.Tensor] | None = None,
        shard_layout: ShardLayout | None = None,
        padding_token_id: int = 0,
        num_chunks: int = 1,
        loss_mask: torch.Tensor | None = None,
        invoke_pre_embed: bool = True,
        extra_seq_buffers: dict[str, int] | None = None,
    ) -> None:
        if shard_batch is not None:
            if (
                model is not None
                or batch is not None
                or num_chunks != 1
                or not invoke_pre_embed
                or extra_seq_buffers is not None
            ):
                raise TypeError("shard_batch is mutually exclusive with model, batch, and strategy-resolution options")
            self.shard_batch = shard_batch
            self.local_token_global_indices = local_token_global_indices
            self.shard_layout = shard_layout
            names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
            self._cp_mesh = device_mesh["cp"] if "cp" in names else None
            self._tp_mesh = device_mesh["tp"] if "tp" in names else None
            self._loss_mask = loss_mask
            self._padding_token_id = padding_token_id
            return
        if local_token_global_indices is not None or shard_layout is not None:
            raise TypeError("local_token_global_indices and shard_layout require shard_batch")
        if batch is None:
            raise TypeError("batch is required when shard_batch is not provided")
        raise NotImplementedError(
            "ContextParallelSharder(model=..., batch=...): resolving a model's strategy needs the framework's "
            "model dispatch; construct it from the shard_batch a prepare_cp_inputs hook returned instead"
        )

    def __repr__(self) -> str:
        return f"ContextParallelSharder(cp_mesh={self._cp_mesh!r}, shard_layout={self.shard_layout!r})"

    def shard(self, batch: dict[str, Any]) -> tuple[CtxFactory, dict[str, Any]]:
        """Shard a batch and retain its layout for token-aligned tensors: ``(ctx_factory, local_batch)``."""
        ctx, local, self.shard_layout = self.shard_batch(
            self._cp_mesh, self._tp_mesh, batch, loss_mask=self._loss_mask, padding_token_id=self._padding_token_id
        )
        return ctx, local

    @property
    def _cp_size(self) -> int:
        return resolve_mesh(self._cp_mesh, "cp_mesh").size

    def _indices(self, padded_seq_len: int, device: Any) -> torch.Tensor:
        """This rank's global token positions for a padded stream of ``padded_seq_len`` tokens."""
        layout = self.shard_layout or _NO_SHARD_LAYOUT
        captured = layout.local_token_global_indices
        if captured is not None:
            expected = captured.numel() * self._cp_size
            if padded_seq_len != expected:
                raise ValueError(
                    f"the reported CP indices cover a padded stream of {expected} tokens ({captured.numel()} local x "
                    f"cp_size {self._cp_size}), got padded_seq_len={padded_seq_len}; the tensor does not match the "
                    "batch this sharder last sharded"
                )
            return captured.reshape(-1).to(device=device, dtype=torch.long)
        if self.local_token_global_indices is None:
            raise NotImplementedError(
                "this ContextParallelSharder has a data-dependent token layout; its index map arrives with the "
                "shard layout: call shard(batch) first"
            )
        return self.local_token_global_indices(self._cp_mesh, padded_seq_len, device)

    @staticmethod
    def _seq_dim(tensor: Any, seq_dim: Any, what: str) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"ContextParallelSharder.{what}: tensor: expected a torch.Tensor, got {type(tensor).__name__}"
            )
        if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or not -tensor.dim() <= seq_dim < tensor.dim():
            raise ValueError(
                f"ContextParallelSharder.{what}: seq_dim={seq_dim!r} is not a dimension of a {tensor.dim()}-D tensor"
            )
        return seq_dim % tensor.dim()

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        """This rank's tokens of a full-length token-aligned tensor, exactly like the model inputs.

        After :meth:`shard`, a tensor of ``original_seq_len`` tokens is
        right-padded to ``padded_seq_len`` with ``fill`` (``fill=None``:
        ``ValueError``, the pad value must be explicit); one of
        ``padded_seq_len`` tokens is sharded as it is; any other length is a
        ``ValueError``. The result is a new tensor, differentiable with respect
        to ``tensor``. No collective runs.
        """
        dim = self._seq_dim(tensor, seq_dim, "shard_token_tensor")
        layout = self.shard_layout or _NO_SHARD_LAYOUT
        if layout.input_token_stream_positions is not None and tuple(tensor.shape) == tuple(
            layout.input_token_stream_positions.shape
        ):
            if fill is None:
                raise ValueError("sharding an input-coordinate tensor on a repositioned layout requires `fill`")
            positions = layout.input_token_stream_positions.to(tensor.device)
            assert layout.padded_seq_len is not None  # a layout that moves tokens says where to
            valid = positions >= 0
            moved = torch.full((tensor.shape[0], layout.padded_seq_len), fill, dtype=tensor.dtype, device=tensor.device)
            moved[valid.nonzero(as_tuple=True)[0], positions[valid]] = tensor[valid]
            tensor, dim = moved, 1
        elif layout.input_row_shape is not None and tuple(tensor.shape[: len(layout.input_row_shape)]) == tuple(
            layout.input_row_shape
        ):
            tensor, dim = tensor.reshape(-1, *tensor.shape[len(layout.input_row_shape) :]), 0
        length = tensor.shape[dim]
        if layout.padded_seq_len is not None and length != layout.padded_seq_len:
            if fill is not None and layout.original_seq_len is not None and length == layout.original_seq_len:
                tensor = pad_tokens(tensor, layout.padded_seq_len, dim, fill)
            else:
                raise ValueError(
                    f"ContextParallelSharder.shard_token_tensor: this sharder sharded a batch of padded_seq_len="
                    f"{layout.padded_seq_len} (original_seq_len={layout.original_seq_len}), got a tensor of length "
                    f"{length} on dim {seq_dim}; pass the original-length tensor with an explicit `fill`, or pre-pad it"
                )
        return tensor.index_select(dim, self._indices(tensor.shape[dim], tensor.device))

    def gather_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False, fill: float | int | None = None
    ) -> torch.Tensor:
        """Differentiably gather every rank's local ``[.., L, ..]`` shard to global token order ``[.., N*L, ..]``.

        One all-gather of the payload (its gradient: one reduce-scatter) and one
        of the index maps. ``trim=True`` returns the caller's coordinates:
        sliced to ``original_seq_len`` (or un-flattened / mapped back, for the
        layouts that report so); ``RuntimeError`` when nothing was sharded yet.
        ``ValueError`` on every rank when ranks pass different shapes.
        """
        cp = resolve_mesh(self._cp_mesh, "cp_mesh")
        api = "ContextParallelSharder.gather_token_tensor"
        if not cp.single:
            is_tensor = isinstance(tensor, torch.Tensor)
            needs_grad = torch.is_grad_enabled() and is_tensor and tensor.requires_grad
            same_dim = seq_dim % tensor.dim() if is_tensor and isinstance(seq_dim, int) and tensor.dim() else seq_dim
            _transport.agree(
                cp, api, {"tensor": tensor}, flags={"requires_grad": needs_grad}, extra=("seq_dim", same_dim)
            )
        dim = self._seq_dim(tensor, seq_dim, "gather_token_tensor")
        layout = self.shard_layout or _NO_SHARD_LAYOUT
        if trim and layout is _NO_SHARD_LAYOUT:
            raise RuntimeError(f"{api}: no shard layout recorded to trim to; call shard(batch) first")
        indices = self._indices(tensor.shape[dim] * cp.size, tensor.device)
        if cp.single:
            full = tensor.index_select(dim, torch.argsort(indices))
        else:
            parts = _transport.gather_along(tensor, cp, dim, differentiable=True)
            all_indices = _transport.gather_along(indices.contiguous(), cp, 0, differentiable=False)
            full = parts.index_select(dim, torch.argsort(all_indices))
        if not trim:
            return full
        if layout.padded_seq_len is not None and full.shape[dim] != layout.padded_seq_len:
            raise ValueError(
                f"{api}: gathered length {full.shape[dim]} on dim {seq_dim} != reported padded_seq_len "
                f"{layout.padded_seq_len}; the local shard does not match the batch this sharder last sharded"
            )
        if layout.input_token_stream_positions is not None:
            if fill is None:
                raise ValueError("trimming to input coordinates on a repositioned layout requires `fill`")
            positions = layout.input_token_stream_positions.to(full.device)
            out = full.gather(1, positions.clamp(min=0).to(torch.long))
            return out.masked_fill(positions < 0, fill)
        if layout.input_row_shape is not None:
            return full.reshape(*layout.input_row_shape, *full.shape[dim + 1 :])
        if layout.original_seq_len is not None:
            return full.narrow(dim, 0, layout.original_seq_len)
        raise NotImplementedError(f"{api}: this sharder has no shard layout to trim to; gather with trim=False")


def unresolved(shard_batch: Callable[..., Any], layout: TokenLayout) -> ContextParallelSharder:
    """What a hook returns: ``ContextParallelSharder(shard_batch=..., local_token_global_indices=...)``."""
    return ContextParallelSharder(shard_batch=shard_batch, local_token_global_indices=layout.local_token_global_indices)
