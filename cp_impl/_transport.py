"""Collectives of :mod:`cp_impl`: the shape handshake and differentiable transport.

Every collective is called through the ``torch.distributed`` module attribute
at call time (``dist.all_gather_single(...)``), so that a harness can wrap
those attributes to count bytes.  Nothing here runs for a single rank: the
public functions return before reaching this module when ``CPMesh.single``.

Communication per call (``N`` ranks, local payload ``P`` bytes):

- handshake: one ``all_gather_single`` of ``DESCRIPTOR_LEN`` int64 per rank;
- gather: one ``all_gather_single`` of ``P`` forward, one
  ``reduce_scatter_single`` of ``N*P`` backward (bfloat16/float16: one
  ``all_to_all_single`` of the same bytes instead, summed locally in float32);
- halo: point-to-point messages from exactly the ranks that own the history
  rows, and the reverse messages for the gradient;
- boundary: one ``[B]`` int64 message from rank ``r+1`` to rank ``r``;
- count: one ``all_reduce`` of one int64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._mesh import CPMesh, resolve_mesh

__all__ = [
    "DESCRIPTOR_LEN",
    "agree",
    "gather_along",
    "gather_public",
    "halo_history",
    "receive_from_next",
    "all_reduce_sum",
]

DESCRIPTOR_LEN = 16
_HEADER = 4  # tag, flags, extra, local error code
_BODY = DESCRIPTOR_LEN - _HEADER
_NOT_A_TENSOR = -1
_NOT_AN_INT = -(2**62)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_MASK61 = (1 << 61) - 1


def _digest(values: Sequence[int] | str) -> int:
    """Deterministic (process-independent) 61-bit digest."""
    if isinstance(values, str):
        values = list(values.encode())
    h = 1469598103934665603 & _MASK61
    for v in values:
        h = (h * 1099511628211 + (int(v) & 0xFFFFFFFFFFFFFFFF)) & _MASK61
    return h


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    return len(_DTYPES) + _digest(str(dtype)) % 1000


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else f"dtype#{code}"


def _encode_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and -(2**62) < value < 2**62:
        return value
    return _NOT_AN_INT


def _describe(row: Sequence[int], names: Sequence[str], flag_names: Sequence[str], extra_name: str | None) -> str:
    """Human-readable form of one rank's descriptor row."""
    parts: list[str] = []
    body = list(row[_HEADER:])
    pos = 0
    for name in names:
        if pos >= len(body):
            parts.append(f"{name}=<digest>")
            continue
        code = body[pos]
        pos += 1
        if code == _NOT_A_TENSOR:
            parts.append(f"{name}=<not a tensor>")
            continue
        ndim = code % 64
        dims = body[pos : pos + ndim]
        pos += ndim
        parts.append(f"{name}={_dtype_name(code // 64)}{list(dims)}")
    for i, fname in enumerate(flag_names):
        parts.append(f"{fname}={bool((row[1] >> i) & 1)}")
    if extra_name is not None:
        parts.append(f"{extra_name}={'<not an int>' if row[2] == _NOT_AN_INT else row[2]}")
    return ", ".join(parts)


def agree(
    cp: CPMesh,
    api: str,
    tensors: Mapping[str, Any],
    *,
    flags: Mapping[str, bool] | None = None,
    extra: tuple[str, Any] | None = None,
    local_error: tuple[int, str] | None = None,
    error_texts: Mapping[int, str] | None = None,
    hint: str = "",
) -> None:
    """Shape/dtype handshake: raise the same ``ValueError`` on every rank or none.

    Each rank contributes one int64 descriptor of length ``DESCRIPTOR_LEN``:
    a tag naming ``api``, bit flags (``flags``), one integer argument
    (``extra``), a local error code, then for each entry of ``tensors`` its
    dtype, rank and shape (a non-tensor is encoded as such).  One
    ``all_gather_single`` exchanges them.  When any rank reports a local error
    (``local_error = (code, message)``, code > 0) or the descriptors differ,
    every rank raises ``ValueError`` before any payload collective runs, so
    that no rank is left waiting in a collective.
    """
    flags = dict(flags or {})
    body: list[int] = []
    for value in tensors.values():
        if isinstance(value, torch.Tensor):
            body.append(_dtype_code(value.dtype) * 64 + value.dim())
            body.extend(int(d) for d in value.shape)
        else:
            body.append(_NOT_A_TENSOR)
    if len(body) > _BODY:
        body = body[: _BODY - 1] + [_digest(body[_BODY - 1 :])]
    body += [0] * (_BODY - len(body))
    flag_bits = sum(int(bool(v)) << i for i, v in enumerate(flags.values()))
    err_code = int(local_error[0]) if local_error else 0
    header = [_digest(api), flag_bits, _encode_int(extra[1]) if extra else 0, err_code]
    device = cp.handshake_device(next(iter(tensors.values()), None))
    mine = torch.tensor(header + body, dtype=torch.int64, device=device)
    everyone = torch.empty(cp.size * DESCRIPTOR_LEN, dtype=torch.int64, device=device)
    dist.all_gather_single(everyone, mine, group=cp.group)
    rows = everyone.view(cp.size, DESCRIPTOR_LEN).tolist()

    flag_names = list(flags)
    extra_name = extra[0] if extra else None
    if any(row[0] != rows[0][0] for row in rows):
        raise ValueError(
            f"{api}: the ranks of the CP mesh are not in the same collective call "
            f"(rank {cp.rank} is in {api}); every rank must call the same CP "
            f"functions in the same order"
        )
    no_err = [row[:3] + [0] + row[4:] for row in rows]
    if any(row != no_err[0] for row in no_err):
        listing = "; ".join(
            f"rank {i}: {_describe(row, list(tensors), flag_names, extra_name)}" for i, row in enumerate(rows)
        )
        raise ValueError(
            f"{api}: every rank of the CP mesh must pass the same shapes, dtypes and "
            f"arguments, got {listing}. {hint}".rstrip()
        )
    bad = [i for i, row in enumerate(rows) if row[3] != 0]
    if bad:
        if err_code:
            assert local_error is not None  # err_code is its code
            raise ValueError(f"{local_error[1]} (CP ranks {bad} rejected their input; every rank raises)")
        texts = dict(error_texts or {})
        first = rows[bad[0]][3]
        raise ValueError(
            f"{api}: CP rank(s) {bad} rejected their local input: "
            f"{texts.get(first, 'see the error raised on that rank')}; every rank raises so that "
            f"none waits in a collective"
        )


# ----------------------------------------------------------------- gather


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Contiguous tensor in a dtype every backend moves (bool travels as uint8)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _all_gather(value: torch.Tensor, cp: CPMesh, dim: int) -> torch.Tensor:
    send = _wire(value)
    out = torch.empty(cp.size * send.numel(), dtype=send.dtype, device=send.device)
    dist.all_gather_single(out, send.view(-1), group=cp.group)
    if value.dtype == torch.bool:
        out = out.view(torch.bool)
    shape = list(value.shape)
    out = out.view(cp.size, *shape)
    merged = shape[:dim] + [cp.size * shape[dim]] + shape[dim + 1 :]
    if dim == 0:
        return out.view(merged)
    return out.movedim(0, dim).reshape(merged)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of bfloat16/float16 values are accumulated in float32 and rounded once; other dtypes in themselves."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _reduce_scatter(grad: torch.Tensor, cp: CPMesh, dim: int) -> torch.Tensor:
    """Sum over ranks of every rank's gradient slice of this rank's shard.

    float32/float64: one ``reduce_scatter_single`` (the backend sums in the
    payload's dtype). bfloat16/float16: a backend would keep its partial sums in
    the payload's precision and round ``N - 1`` times, so the slices travel
    unchanged in one ``all_to_all_single`` (the same bytes per rank) and are
    summed here in float32, in rank order, then rounded once.
    """
    shape = list(grad.shape)
    local = shape[dim] // cp.size
    split = shape[:dim] + [cp.size, local] + shape[dim + 1 :]
    chunks = grad.reshape(split).movedim(dim, 0).contiguous()  # [N, ..., local, ...]
    if grad.dtype in LOW_PRECISION:
        received = torch.empty_like(chunks)  # received[i]: rank i's gradient of this rank's shard
        dist.all_to_all_single(received.view(cp.size, -1), chunks.view(cp.size, -1), group=cp.group)
        total = received[0].to(torch.float32)
        for i in range(1, cp.size):
            total = total + received[i].to(torch.float32)
        return total.to(grad.dtype)
    out = torch.empty(chunks.shape[1:], dtype=grad.dtype, device=grad.device)
    dist.reduce_scatter_single(out.view(-1), chunks.view(-1), group=cp.group)
    return out


class _GatherFn(torch.autograd.Function):
    """All-gather forward; reduce-scatter (sum over ranks) of the gradient backward."""

    @staticmethod
    def forward(ctx, value, cp, dim):  # type: ignore[override]
        ctx.cp, ctx.dim = cp, dim
        return _all_gather(value, cp, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.cp, ctx.dim), None, None


def gather_along(value: torch.Tensor, cp: CPMesh, dim: int, differentiable: bool) -> torch.Tensor:
    """Concatenate every rank's ``value`` along ``dim`` in CP rank order (new tensor).

    Shapes were agreed by :func:`agree` beforehand.  ``differentiable=False``
    returns a result without autograd history.
    """
    if differentiable:
        return _GatherFn.apply(value, cp, dim)
    with torch.no_grad():
        return _all_gather(value.detach(), cp, dim)


def gather_public(value: Any, mesh: Any, differentiable: Any, *, api: str, dim: int) -> torch.Tensor:
    """Body of ``gather_sequence`` (``dim=1``) and ``gather_tokens`` (``dim=0``).

    Handshake first (shapes, dtypes, ``differentiable`` and whether the input
    needs a gradient must agree on every rank), then argument checks that are
    identical on every rank, then the all-gather.
    """
    cp = resolve_mesh(mesh)
    if not cp.single:
        needs_grad = (
            differentiable is True
            and torch.is_grad_enabled()
            and isinstance(value, torch.Tensor)
            and value.requires_grad
        )
        agree(
            cp,
            api,
            {"value": value},
            flags={"requires_grad": needs_grad},
            extra=("differentiable", int(differentiable) if isinstance(differentiable, bool) else None),
            hint="Pass equal-length shards of one padded global batch on every rank.",
        )
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{api}: value: expected a torch.Tensor, got {type(value).__name__}")
    if not isinstance(differentiable, bool):
        raise TypeError(f"{api}: differentiable: expected True or False, got {type(differentiable).__name__}")
    if value.dim() <= dim:
        wanted = "[batch, local_sequence, ...]" if dim == 1 else "[local_tokens, ...]"
        raise ValueError(f"{api}: value: expected this rank's shard {wanted}, got shape {list(value.shape)}")
    if cp.single:
        return value
    return gather_along(value, cp, dim, differentiable)


# ------------------------------------------------------------------- halo


def _halo_plan(cp: CPMesh, local: int, history: int):
    """Point-to-point plan for ``history`` rows before each shard of ``local`` rows.

    Returns ``(recv, send)``: ``recv`` lists ``(src, hist_start, count)``
    (rows this rank needs, placed at ``hist_start`` of its history block),
    ``send`` lists ``(dst, local_start, count)`` (own rows another rank needs).
    """
    r, n = cp.rank, cp.size

    def needs(dst: int, src: int) -> tuple[int, int] | None:
        lo = max(dst * local - history, src * local)
        hi = min((src + 1) * local, dst * local)
        return (lo, hi - lo) if hi > lo else None

    recv, send = [], []
    for src in range(r):
        got = needs(r, src)
        if got:
            recv.append((src, got[0] - (r * local - history), got[1]))
    for dst in range(r + 1, n):
        got = needs(dst, r)
        if got:
            send.append((dst, got[0] - r * local, got[1]))
    return recv, send


def _exchange(cp: CPMesh, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """One batch of point-to-point messages; waits for all of them."""
    ops = [dist.P2POp(dist.isend, t, peer=cp.global_rank(p), group=cp.group) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer=cp.global_rank(p), group=cp.group) for p, t in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _HaloFn(torch.autograd.Function):
    """Prepend ``history`` rows owned by earlier ranks; gradients go back to their owners."""

    @staticmethod
    def forward(ctx, masked, cp, history):  # type: ignore[override]
        batch, local, channels = masked.shape
        recv, send = _halo_plan(cp, local, history)
        ctx.cp, ctx.history, ctx.plan = cp, history, (recv, send)
        out = masked.new_zeros(batch, local + history, channels)
        out[:, history:] = masked
        if masked.numel() == 0:
            return out
        wire = _wire(masked)
        buffers = [
            (src, torch.empty(batch, count, channels, dtype=wire.dtype, device=wire.device)) for src, _, count in recv
        ]
        outgoing = [(dst, wire[:, start : start + count].contiguous()) for dst, start, count in send]
        _exchange(cp, outgoing, buffers)
        for (_, hist_start, count), (_, buf) in zip(recv, buffers):
            out[:, hist_start : hist_start + count] = buf.view(masked.dtype) if masked.dtype == torch.bool else buf
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cp, history = ctx.cp, ctx.history
        recv, send = ctx.plan
        grad_in = grad[:, history:].clone(memory_format=torch.contiguous_format)
        if grad_in.numel() == 0:
            return grad_in, None, None
        batch, _, channels = grad_in.shape
        outgoing = [(src, grad[:, hs : hs + count].contiguous()) for src, hs, count in recv]
        buffers = [
            (dst, torch.empty(batch, count, channels, dtype=grad.dtype, device=grad.device)) for dst, _, count in send
        ]
        _exchange(cp, outgoing, buffers)
        # A row's own gradient plus those of every later rank that read it: accumulated in float32 for
        # bfloat16/float16 and rounded once, like the gather's backward.
        wide = grad_in.to(accumulation_dtype(grad_in.dtype))
        for (_, start, count), (_, buf) in zip(send, buffers):
            wide[:, start : start + count] += buf
        return (wide if wide.dtype == grad_in.dtype else wide.to(grad_in.dtype)), None, None


def halo_history(masked: torch.Tensor, cp: CPMesh, history: int) -> torch.Tensor:
    """``[B, history + L, C]``: the ``history`` global rows before this shard, then ``masked``."""
    return _HaloFn.apply(masked, cp, history)


# ------------------------------------------------------- loss boundary


def receive_from_next(first: torch.Tensor, cp: CPMesh, fill: int) -> torch.Tensor:
    """Send ``first`` to rank ``r-1``; return what rank ``r+1`` sent (``fill`` on the last rank)."""
    incoming = torch.full_like(first, fill)
    sends = [(cp.rank - 1, first.contiguous())] if cp.rank > 0 else []
    recvs = [(cp.rank + 1, incoming)] if cp.rank < cp.size - 1 else []
    _exchange(cp, sends, recvs)
    return incoming


def all_reduce_sum(value: torch.Tensor, cp: CPMesh) -> torch.Tensor:
    """Sum of ``value`` over the mesh (new tensor; the input is left alone)."""
    out = value.clone()
    dist.all_reduce(out, group=cp.group)
    return out
