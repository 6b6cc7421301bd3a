"""What the Kimi specs (``kimi_linear``, ``kimi_k3``) share: the same CP design in two copies of the framework's
code (``kimi_linear/`` and ``kimi_k3/``: distinct MLA modules, model modules and ``KimiPackedContext`` classes), so
each spec passes its own copies in. Why a CPU judges their CP step forward only (``no_cpu_backward``), the uncompiled
FlexAttention their CP forward runs on CPU (``flex_attention_for``), and the kernel check's context
(``mla_cp_kernels``: the one-device forward through each MLA module's CP forward over a world of one rank).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from examples.automodel.models import model_owned_cp


def no_cpu_backward(model: str) -> str:
    """Why the CP step of ``model`` (``kimi_linear``, ``kimi_k3``: the same Kimi CP code) is judged forward only on
    CPU: its MLA layers' FlexAttention."""
    return (
        "torch 2.13 has no FlexAttention backward on CPU: in a training step the CP forward of every MLA layer "
        f"({model}/cp.py document_causal_flex_attention) raises 'NotImplementedError: FlexAttention does not "
        "support backward on CPU. Please set the input requires_grad to False or use another device.' "
        "(torch/nn/attention/flex_attention.py _validate_device); without grad the compiled kernel fails to "
        "build ('torch._inductor.exc.InductorError: CppCompileError: C++ compile error ... error: "
        "'cur_qSplitSize7' was not declared in this scope'), so on CPU the forward runs under torch.no_grad() "
        "with FlexAttention uncompiled"
    )


@contextlib.contextmanager
def flex_attention_for(model: torch.nn.Module, cache: list) -> Iterator[None]:
    """On CPU, the framework's FlexAttention cache ``cache`` (a one-element list) holds the uncompiled function
    for the call, and its previous content afterwards."""
    if next(model.parameters()).device.type != "cpu":
        yield
        return
    saved = cache[0]
    cache[0] = model_owned_cp.flex_attention_eager()
    try:
        yield
    finally:
        cache[0] = saved


class _OneRank:
    """A CP mesh of one rank, as ``KimiMLAAttention._forward_with_cp`` uses its mesh: ``get_group()`` returns
    this object, and over it the all-gather of the latent is the identity (a world of one holds the whole
    sequence); see ``mla_cp_kernels``."""

    def get_group(self) -> _OneRank:
        return self


_ONE_RANK = _OneRank()


def _gather_over_one_rank(gather: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``all_gather_sequence`` that returns its input over the one-rank group (``_ONE_RANK``) and calls
    ``gather`` over any other group."""

    def all_gather_sequence(tensor: torch.Tensor, cp_group: Any, *, dim: int = 1) -> torch.Tensor:
        return tensor if cp_group is _ONE_RANK else gather(tensor, cp_group, dim=dim)

    return all_gather_sequence


def _mla_forward_with_cp_kernels(
    layer: Any,
    framework_module: Any,
    packed_context_class: type,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    packed_context: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """One MLA layer's forward ``[B, S, hidden] -> [B, S, hidden]`` through its CP forward on one rank."""
    if packed_context is not None and packed_context.cp_enabled:  # a real CP batch: the layer's own forward
        return type(layer).forward(
            layer, hidden_states, attention_mask=attention_mask, packed_context=packed_context, **kwargs
        )
    if packed_context is None:  # the model derives no document map for rows of one unpadded document each;
        # the CP sharder's map for such rows is all ones (cp._global_doc_ids_from_batch)
        rows, length = hidden_states.shape[:2]
        packed_context = packed_context_class(
            doc_ids=torch.ones((rows, length), dtype=torch.int32, device=hidden_states.device)
        )
    saved = framework_module.all_gather_sequence
    framework_module.all_gather_sequence = _gather_over_one_rank(saved)
    try:
        return layer._forward_with_cp(hidden_states, packed_context)
    finally:
        framework_module.all_gather_sequence = saved


@contextlib.contextmanager
def mla_cp_kernels(
    model: torch.nn.Module, attention_class: type, framework_module: Any, packed_context_class: type, description: str
) -> Iterator[str]:
    """Inside: every ``attention_class`` (MLA) module of ``model`` computes its one-device forward with the CP
    path's attention kernel; ``description`` is the context's value. Shared by ``kimi_linear`` and
    ``kimi_k3`` (their MLA modules, model modules and ``KimiPackedContext`` classes are distinct copies).

    What changes, for the duration and on ``model``'s MLA modules only:

    * each MLA module's ``forward`` is its CP forward, the framework's ``_forward_with_cp(hidden_states,
      packed_context)``: the same projections, with attention by ``cp.document_causal_flex_attention``
      (FlexAttention under the causal per-document block mask ``_document_causal_block_mask``, head dims
      zero-padded to powers of two, output of padding queries zeroed) instead of matmul, additive mask,
      float32 softmax rounded to the model dtype, matmul;
    * the document map is the one the model derives on one device (``packed_context``: from a 2-D
      ``attention_mask`` or ``_packed_seq_ids``), or all ones ``[B, S]`` where it derives none, which is the
      map CP's sharder resolves for such rows; ``seq_start`` 0, ``cp_size`` 1: queries and keys are the
      whole sequence, no shard, no CP padding;
    * the module's ``_cp_mesh`` is a one-rank stand-in (``_ONE_RANK``), and the framework's
      ``all_gather_sequence`` over it (the module-level name ``_forward_with_cp`` calls, replaced for each
      call only) returns its input: the all-gather of a world of one.

    Nothing else changes: the batch, the other modules (MoE routers and experts, norms, the LM head), the
    parameters; FlexAttention runs as the spec's ``forward`` sets it (uncompiled on CPU). On exit every
    module's own ``forward`` and ``_cp_mesh`` are back.
    """
    layers: list[Any] = [m for m in model.modules() if isinstance(m, attention_class)]
    saved = [(layer, layer._cp_mesh) for layer in layers]
    try:
        for layer in layers:
            layer.forward = functools.partial(
                _mla_forward_with_cp_kernels, layer, framework_module, packed_context_class
            )
            layer._cp_mesh = _ONE_RANK
        yield description
    finally:
        for layer, mesh in saved:
            layer.__dict__.pop("forward", None)
            layer._cp_mesh = mesh
