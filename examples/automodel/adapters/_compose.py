"""Build an implementation under test from ``cp_impl`` with single functions replaced.

An adapter module serves one documented function from the framework's code
and everything else from the bundled ``cp_impl``: :func:`compose` copies the
public names of ``cp_impl.inkling2`` / ``cp_impl.mistral_large4`` into new
module objects and overrides the given ones. ``cp_impl`` itself is never
modified (the rank pool and the test process may hold both at once).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

import cp_impl


def _copy(source: types.ModuleType, name: str, overrides: Mapping[str, Callable[..., Any]]) -> types.ModuleType:
    module = types.ModuleType(name, f"{source.__name__} with {', '.join(sorted(overrides)) or 'nothing'} replaced")
    for attr in dir(source):
        if not attr.startswith("_"):
            setattr(module, attr, getattr(source, attr))
    for attr, fn in overrides.items():
        if not callable(getattr(source, attr, None)):
            raise AttributeError(f"{source.__name__} has no documented function {attr!r} to replace")
        setattr(module, attr, fn)
    return module


def compose(
    adapter: str,
    *,
    inkling2: Mapping[str, Callable[..., Any]] | None = None,
    mistral_large4: Mapping[str, Callable[..., Any]] | None = None,
) -> tuple[types.ModuleType, types.ModuleType]:
    """``(inkling2, mistral_large4)`` modules: ``cp_impl``'s, with the given functions replaced."""
    return (
        _copy(cp_impl.inkling2, f"{adapter}.inkling2", inkling2 or {}),
        _copy(cp_impl.mistral_large4, f"{adapter}.mistral_large4", mistral_large4 or {}),
    )


def cp_group(mesh: Any):
    """The process group of a 1-D CP ``DeviceMesh``; ``None`` for ``mesh=None`` or one rank.

    This is the translation every framework primitive below needs: the
    documented API takes a mesh, the framework's functions take a group.
    """
    if mesh is None or mesh.size() == 1:
        return None
    return mesh.get_group()


def autograd_if(differentiable: bool):
    """The documented ``differentiable`` flag as a context: ``False`` records no autograd history.

    The framework's gathers have no such argument (they follow the input's
    ``requires_grad``); running them under ``torch.no_grad()`` is how their
    own callers gather metadata without history.
    """
    return contextlib.nullcontext() if differentiable else torch.no_grad()
