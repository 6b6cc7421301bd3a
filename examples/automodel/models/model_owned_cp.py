"""Helpers shared by the specs of models that own their CP attention (``gemma4_moe``, ``kimi_linear``, ``kimi_k3``,
``qwen3_8_flash_next``, ``glm5_next``).

Both models install their CP attention once, on the model object, and keep it: Gemma4's
``setup_cp_attention`` sets ``_cp_enabled`` (never cleared) and closes its SDPA hook over the first CP mesh
it is given; Kimi's ``apply_cp`` stores the mesh on every attention and MoE module. A training process has one
mesh for its life, but a rank process of the harness runs CP 2, CP 3 and the one-device reference on the same
cached model. So a spec enters CP on a *CP twin*: a deep copy of the model that shares its ``Parameter``
objects (gradients land on the model the caller reads them from) and has its own modules, buffers, config and
hooks, built once per (model, mesh). The one-device reference runs the untouched model, like a separate
one-device training process.

Nothing here changes what the framework computes: ``apply_moe_cp`` runs the framework's own
``nemo_automodel.components.moe.parallelizer.apply_cp`` (the CP step of the MoE parallelizer, which the
infrastructure runs at ``ep_size > 1``). That function imports Transformer Engine's ``DotProductAttention``
only to ask ``isinstance`` of each attention module; where TE is not installed (CPU) a placeholder class
nothing is an instance of is put in ``sys.modules`` for that call and removed afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

_TE_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention")


@contextlib.contextmanager
def _transformer_engine_placeholder() -> Iterator[None]:
    """``transformer_engine.pytorch.attention.DotProductAttention`` importable for the duration, when TE is absent."""
    if importlib.util.find_spec("transformer_engine") is not None:
        yield
        return
    saved = {name: sys.modules.get(name) for name in _TE_MODULES}
    modules = [types.ModuleType(name) for name in _TE_MODULES]
    vars(modules[2])["DotProductAttention"] = type("DotProductAttention", (), {})  # no module is an instance of it
    sys.modules.update(zip(_TE_MODULES, modules))
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def apply_moe_cp(model: torch.nn.Module, cp_mesh: Any) -> None:
    """The framework's ``apply_cp(model, cp_mesh)``: CP flags and mesh on the model, each block's
    ``self_attn.setup_cp_attention(cp_mesh)``, ``cp_mesh`` on each MoE module."""
    from nemo_automodel.components.moe.parallelizer import apply_cp

    with _transformer_engine_placeholder():
        apply_cp(model, cp_mesh)


_TWINS: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, tuple[Any, torch.nn.Module]]] = weakref.WeakKeyDictionary()


def cp_twin(model: torch.nn.Module, cp_mesh: Any, enter: Callable[[torch.nn.Module, Any], None]) -> torch.nn.Module:
    """The CP twin of ``model`` for ``cp_mesh``: built on first use (``enter(twin, cp_mesh)`` installs CP on it),
    then cached. It shares every ``Parameter`` with ``model``; ``model`` itself is never touched."""
    twins = _TWINS.setdefault(model, {})
    entry = twins.get(id(cp_mesh))
    if entry is None or entry[0] is not cp_mesh:
        twin = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
        enter(twin, cp_mesh)
        entry = twins[id(cp_mesh)] = (cp_mesh, twin)  # the mesh is held, so its id is not reused
    return entry[1]


def cp_active(mesh: Any) -> bool:
    """Whether ``mesh`` is a CP mesh of more than one rank (else the framework uses its identity sharder)."""
    return mesh is not None and mesh.size() > 1


def flex_attention_eager() -> Callable[..., Any]:
    """``torch.nn.attention.flex_attention.flex_attention`` uncompiled.

    The framework compiles FlexAttention (``torch.compile(flex_attention, dynamic=True)``). On CPU, torch 2.13's
    inductor refuses the ring's call (``torch.compile on CPU only supports inference and `return_lse` is not
    supported yet``) and fails to build Kimi's document-causal kernel (``CppCompileError``: ``'cur_qSplitSize7'
    was not declared in this scope``). The specs hand this function to the framework's own per-model compile
    cache on CPU only; every other step of the CP path is the framework's.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


TWIN_KEY = "_spec_cp_model"  # the local batch's entry that carries the CP twin from ``shard`` to ``forward``


def shard_on_twin(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    padding_token_id: int = 0,
    *,
    enter: Callable[[torch.nn.Module, Any], None] = apply_moe_cp,
    one_device: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[Callable[[], Any], dict[str, Any], ContextParallelSharder]:
    """``ContextParallelSharder(target, mesh, batch)`` then ``shard`` (the recipe's step), where ``target`` is the
    model's CP twin (``enter`` installs CP on it) when ``mesh`` has more than one rank, else ``model`` itself on the
    batch ``one_device(batch)`` (unchanged when ``None``). ``model`` and ``batch`` are never modified.

    Returns ``(ctx_factory, local_batch, sharder)``: ``local_batch`` tensors ``[B, S_local]``, the model's CP
    context and, under CP, the twin under ``TWIN_KEY`` (what ``twin_forward`` runs).
    """
    batch = dict(batch)
    target = model
    if cp_active(mesh):
        target = cp_twin(model, mesh, enter)
    elif one_device is not None:
        batch = one_device(batch)
    sharder = ContextParallelSharder(target, mesh, batch, padding_token_id=padding_token_id)
    ctx_factory, local_batch = sharder.shard(batch)
    if target is not model:
        local_batch[TWIN_KEY] = target
    return ctx_factory, local_batch, sharder


def twin_forward(model: torch.nn.Module, local_batch: dict[str, Any]) -> torch.Tensor:
    """The model (or the CP twin ``shard_on_twin`` put in the batch) on this rank's shard, inside ``ctx_factory()``:
    logits ``[B, S_local, V]`` (``filter_forward_kwargs`` on the batch without its labels, as the recipe calls it)."""
    target = local_batch.get(TWIN_KEY, model)
    kwargs = {key: value for key, value in local_batch.items() if key not in ("labels", TWIN_KEY)}
    return target(**filter_forward_kwargs(target, kwargs)).logits
