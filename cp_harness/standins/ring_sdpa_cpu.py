"""Stand-in ``ring_sdpa_cpu``: torch ``context_parallel``'s ring SDPA with the CPU flash kernel as its per-step op.

Torch's ring (``torch.distributed.tensor.experimental._context_parallel._attention``) is a template over an
attention op: ``_templated_ring_attention`` (forward: per ring step one attention call on local Q and the K/V
block held, outputs merged by log-sum-exp) and ``_templated_ring_attention_backward`` (per step one backward
call, dK/dV passed rank to rank by all-to-all). Torch instantiates it for the CUDA kernels only: its table
``custom_ops`` maps ``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention`` / ``_cudnn_attention``
and their backwards to a DTensor handler, merged into DTensor's op dispatcher (``_custom_op_handlers``) when
``context_parallel`` is entered and removed when it exits. On a CPU, SDPA dispatches
``aten._scaled_dot_product_flash_attention_for_cpu`` (returns ``output [B, H, S, D], logsumexp [B, H, S]``, natural
log, float32 for a bfloat16 input; its backward takes ``grad_out, query, key, value, out, logsumexp, dropout_p,
is_causal`` and ``scale``), which is in no table: "does not have a sharding strategy registered".

This stand-in adds the CPU op and its backward to torch's table for the duration of ``install()``, with a handler
that takes the DTensors' local shards (every one must be ``Shard(2)`` on a 1-D mesh: a stand-in invents no
sharding strategy), calls torch's two templates with the CPU op and wraps the results as ``Shard(2)`` DTensors.
Torch's own enter/exit of ``context_parallel`` then installs and removes the handler exactly as it does its own,
so the handler is live only inside a CP context, like torch's. Nothing of the ring is written here: the
head-tail load balancer, the rotation (all-gather or all-to-all), the LSE merge and the gradient routing are
torch's. Torch's merger and gradient accumulation work in float32 (``_cp_options.convert_to_f32``): a float64
ring is only float32-accurate, a property of torch's ring, not of this stand-in.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from cp_harness.standins.registry import StandIn, register

# DTensor and torch's CP module are imported where used: importing torch.distributed.tensor costs seconds, and
# every process that loads the harness's checks imports this registry.
aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # torch's ring hard-codes it too ([B, H, S, D]; the LSE [B, H, S])
_CALLS: collections.Counter[object] = (
    collections.Counter()
)  # op -> ring calls made through this stand-in in this process


def _bound(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out = {}
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args):
            out[argument.name] = args[i]
        elif argument.name in kwargs:
            out[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            out[argument.name] = argument.default_value
    return out


def _torch_cp():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def _global_spec(local: torch.Tensor, mesh):
    """The ``Shard(2)`` ``DTensorSpec`` of an evenly sharded ``local`` shard (torch's ring shards evenly)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = list(local.shape)
    shape[SEQ_DIM] *= mesh.size()
    order = sorted(range(local.dim()), key=lambda d: local.stride(d), reverse=True)
    stride = [0] * local.dim()
    running = 1
    for d in reversed(order):
        stride[d] = running
        running *= shape[d]
    return DTensorSpec(mesh, (Shard(SEQ_DIM),), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))


def _handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """DTensor handler for the CPU flash op and its backward: local shards -> torch's ring template -> Shard(2)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    torch_cp = _torch_cp()
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh, schema = info.compute_mesh, info.schema
    assert schema is not None  # unwrap_to_op_info creates it
    specs = [s for s in list(schema.args_schema) + list(schema.kwargs_schema.values()) if isinstance(s, DTensorSpec)]
    wrong = sorted({str(s.placements) for s in specs if s.mesh != mesh or tuple(s.placements) != (Shard(SEQ_DIM),)})
    if mesh.ndim != 1 or wrong:
        raise NotImplementedError(
            f"stand-in ring_sdpa_cpu: {op_call} takes Shard(2) DTensors on one 1-D mesh "
            f"(torch's ring SDPA layout); got mesh of {mesh.ndim} dims, placements {wrong}"
        )
    uneven = [
        tuple(s.shape)
        for s, t in zip(schema.args_schema, info.local_args)
        if isinstance(s, DTensorSpec)
        and isinstance(t, torch.Tensor)
        and s.shape[SEQ_DIM] != t.shape[SEQ_DIM] * mesh.size()
    ]
    if uneven:
        raise NotImplementedError(
            f"stand-in ring_sdpa_cpu: {op_call} takes evenly sharded sequences (torch's ring "
            f"and its load balancer shard evenly); global shapes {uneven} on {mesh.size()} ranks"
        )
    a = _bound(op_call, info.local_args, info.local_kwargs)
    if a.get("attn_mask") is not None:
        raise NotImplementedError(
            "stand-in ring_sdpa_cpu: attn_mask is not supported (torch's ring SDPA takes "
            "none either: causal or full attention only)"
        )
    group = mesh.get_group()
    _CALLS[op_call] += 1
    if op_call is FORWARD:
        results = torch_cp._templated_ring_attention(
            group,
            SEQ_DIM,
            aten._scaled_dot_product_flash_attention_for_cpu,
            query=a["query"],
            key=a["key"],
            value=a["value"],
            is_causal=a["is_causal"],
            dropout_p=a["dropout_p"],
            scale=a["scale"],
        )
    else:
        results = torch_cp._templated_ring_attention_backward(
            group,
            SEQ_DIM,
            BACKWARD,
            grad_out=a["grad_out"],
            grad_out_name="grad_out",
            query=a["query"],
            key=a["key"],
            value=a["value"],
            out=a["out"],
            logsumexp=a["logsumexp"],
            is_causal=a["is_causal"],
            dropout_p=a["dropout_p"],
            scale=a["scale"],
        )
    return DTensor._op_dispatcher.wrap(tuple(results), tuple(_global_spec(r, mesh) for r in results))


def handlers() -> dict[torch._ops.OpOverload, object]:
    """The DTensor handlers live in this process for the two CPU ops: DTensor's dispatcher's and torch CP's table
    (empty when the stand-in is not installed and no CP context holds it)."""
    from torch.distributed.tensor import DTensor

    tables = (DTensor._op_dispatcher._custom_op_handlers, _torch_cp().custom_ops)
    return {op: table[op] for table in tables for op in (FORWARD, BACKWARD) if op in table}


@contextlib.contextmanager
def install() -> Iterator[None]:
    """Add the handler for the CPU op and its backward to torch CP's ``custom_ops`` for the block; removed after.

    Enter it *before* ``context_parallel`` (torch merges its table into DTensor's dispatcher on entry): entered
    inside a CP context it would not be seen, so that raises. If torch already handles either op, this stand-in
    is obsolete, and that raises too (rather than replacing torch's own handler)."""
    from torch.distributed.tensor import DTensor

    torch_cp = _torch_cp()
    if DTensor._op_dispatcher._custom_op_handlers is not torch_cp.existing_custom_ops:
        raise RuntimeError(
            "stand-in ring_sdpa_cpu entered inside a context_parallel context: enter it before "
            "(torch merges its handler table into DTensor's dispatcher when the context starts)"
        )
    present = handlers()
    if any(handler is _handler for handler in present.values()):
        raise RuntimeError("stand-in ring_sdpa_cpu is already installed (entered twice)")
    if present:
        raise RuntimeError(
            f"stand-in ring_sdpa_cpu: torch already has DTensor handlers for {sorted(map(str, present))}"
            f"; the stand-in is not needed (remove it from the spec's STANDINS)"
        )
    torch_cp.custom_ops.update({FORWARD: _handler, BACKWARD: _handler})
    try:
        yield
    finally:
        for op in (FORWARD, BACKWARD):
            torch_cp.custom_ops.pop(op, None)


RING_SDPA_CPU = register(
    StandIn(
        name="ring_sdpa_cpu",
        device_type="cpu",
        replaces="aten._scaled_dot_product_flash_attention (CUDA flash / "
        "memory-efficient / cuDNN SDPA) as torch context_parallel's ring SDPA per-step kernel",
        role="ring SDPA per-step kernel",
        computes_with="aten._scaled_dot_product_flash_attention_for_cpu",
        meets="cuda",
        install=install,
        calls=lambda: sum(_CALLS.values()),
    )
)
