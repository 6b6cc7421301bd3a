"""The contract of the sharder's verbs as the oracle half of ``sharder_verbs`` applies it (private to that check).

``Fields`` are the ``ShardLayout`` fields a rank reported; the rules map a caller's tensor (its shape, ``seq_dim``
and ``fill``) into the padded token stream and back: ``interpret`` says which rule a shape falls under
(``positions``: a repositioned ``[B, S_in]`` tensor; ``rows``: a THD tensor with the reported row shape in front;
``plain``), ``to_stream`` / ``trimmed`` / ``untrim_grad`` / ``stream_to_caller`` are the forward and adjoint maps, and
``form_*`` / ``upstream`` build a case's tensors (exact in every dtype: every sum of N <= 8 upstream values is exact).
"""

from __future__ import annotations

import dataclasses

import torch

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
}


@dataclasses.dataclass
class Fields:
    """The layout fields a rank reported (``positions``: ``[B, S_in]`` or ``None``)."""

    original: int | None
    padded: int | None
    rows: tuple[int, ...] | None
    positions: torch.Tensor | None


def interpret(shape, seq_dim: int, f: Fields) -> tuple[str, int]:
    """Which rule a tensor of ``shape`` falls under, and its sequence dim once in stream coordinates."""
    if f.positions is not None and tuple(shape) == tuple(f.positions.shape):
        return "positions", 1
    if f.rows is not None and tuple(shape[: len(f.rows)]) == tuple(f.rows):
        return "rows", 0
    return "plain", seq_dim


def form_shape(case: dict, form: dict, f: Fields) -> tuple[list[int], int]:
    """``(shape, seq_dim)`` of the caller's tensor of ``form`` under the reported fields."""
    B, lead, trail = int(case["rows"]), list(form["lead"]), list(form["trail"])
    if form["coords"] == "padded":
        return [*lead, 1 if case["layout"] == "thd" else B, f.padded, *trail], 1 + len(lead)
    if case["layout"] == "repositioned" or f.positions is not None:
        assert f.positions is not None, "a repositioned layout reports its positions (_judge_fields checks)"
        return list(f.positions.shape), 1
    return [*lead, B, int(case["seq_len"]), *trail], 1 + len(lead)


def form_fill(form: dict, dtype: str):
    if form["coords"] == "nofill":
        return None
    return bool(form["fill"]) if dtype == "bool" else form["fill"]


def form_value(case: dict, i: int, shape, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(case["seed"]) * 31 + i)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == "int64":
        return torch.randint(-1000, 1000, shape, generator=g)
    return (torch.randint(-64, 64, shape, generator=g).double() / 8).to(_DTYPES[dtype])  # exact in every float


def upstream(case: dict, i: int, rank: int, shape, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(case["seed"]) * 31 + 1000 * (rank + 1) + i)
    return torch.randint(-4, 5, shape, generator=g).to(_DTYPES[dtype])  # every sum of N <= 8 is exact


def to_stream(x: torch.Tensor, seq_dim: int, fill, f: Fields) -> tuple[torch.Tensor, int]:
    """The caller's tensor in padded-stream coordinates, and its sequence dim (``ValueError``: it must raise)."""
    kind, dim = interpret(x.shape, seq_dim, f)
    if kind == "positions":
        assert f.positions is not None and f.padded is not None  # interpret's "positions"; forms need padded
        if fill is None:
            raise ValueError("fill is required on a repositioned layout")
        out = torch.full((x.shape[0], f.padded), fill, dtype=x.dtype)
        valid = f.positions >= 0
        out[valid.nonzero(as_tuple=True)[0], f.positions[valid]] = x[valid]
        return out, 1
    if kind == "rows":
        assert f.rows is not None  # interpret's "rows"
        x = x.reshape(-1, *x.shape[len(f.rows) :])
    if f.padded is not None and x.shape[dim] != f.padded:
        if fill is None or f.original is None or x.shape[dim] != f.original:
            raise ValueError(f"length {x.shape[dim]} is neither padded_seq_len nor original_seq_len with a fill")
        pad = list(x.shape)
        pad[dim] = f.padded - x.shape[dim]
        x = torch.cat((x, torch.full(pad, fill, dtype=x.dtype)), dim)
    return x, dim


def trimmed(full: torch.Tensor, dim: int, fill, f: Fields) -> torch.Tensor:
    if f.positions is not None:
        out = full.gather(1, f.positions.clamp(min=0))
        return out.masked_fill(f.positions < 0, fill)
    if f.rows is not None:
        return full.reshape(*f.rows, *full.shape[dim + 1 :])
    assert f.original is not None  # _judge_fields passes fields without rows only with original_seq_len
    return full.narrow(dim, 0, f.original)


def untrim_grad(grad: torch.Tensor, stream_shape, dim: int, trim: bool, f: Fields) -> torch.Tensor:
    """The gradient of a gather's output, in padded-stream coordinates."""
    if not trim:
        return grad
    out = torch.zeros(stream_shape, dtype=grad.dtype)
    if f.positions is not None:
        valid = f.positions >= 0
        out[valid.nonzero(as_tuple=True)[0], f.positions[valid]] = grad[valid]
    elif f.rows is not None:
        out = grad.reshape(stream_shape)
    else:
        assert f.original is not None  # as in trimmed
        out.narrow(dim, 0, f.original).copy_(grad)
    return out


def stream_to_caller(g: torch.Tensor, shape, seq_dim: int, f: Fields) -> torch.Tensor:
    """A padded-stream gradient in the caller's coordinates (the adjoint of ``to_stream``)."""
    kind, dim = interpret(shape, seq_dim, f)
    if kind == "positions":
        assert f.positions is not None  # interpret's "positions"
        return g.gather(1, f.positions.clamp(min=0)).masked_fill(f.positions < 0, 0)
    if kind == "rows":
        return g.narrow(0, 0, shape[0] * shape[1]).reshape(shape)
    return g.narrow(dim, 0, shape[dim])
