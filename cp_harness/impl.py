"""Finding the implementation under test.

Any importable module that exposes ``inkling2`` and ``mistral_large4`` (as
submodules or plain attributes) with the documented functions can be judged.
The choice comes from ``--cp-impl`` / ``--impl``, else the ``CP_IMPL``
environment variable, else the bundled ``cp_impl``.
"""

from __future__ import annotations

import importlib
import os
import types

DEFAULT_IMPL = "cp_impl"

REQUIRED = {
    "inkling2": ("convolution_history", "gather_sequence", "prepare_cp_inputs", "unpack_row_layout",
                 "validate_document_positions"),
    "mistral_large4": ("gather_tokens", "prepare_cp_inputs", "prepare_packed_cp_inputs", "shifted_cp_loss"),
}


def selected_impl_name(explicit: str | None = None) -> str:
    """The module name to judge: ``explicit``, else ``$CP_IMPL``, else ``cp_impl``."""
    return explicit or os.environ.get("CP_IMPL") or DEFAULT_IMPL


def load_impl(name: str | None = None) -> types.SimpleNamespace:
    """Import the implementation and return ``namespace(name, inkling2, mistral_large4)``.

    Raises ``ImportError`` naming the missing module or function.
    """
    name = selected_impl_name(name)
    root = importlib.import_module(name)
    found = {}
    for part, functions in REQUIRED.items():
        sub = getattr(root, part, None)
        if sub is None:
            try:
                sub = importlib.import_module(f"{name}.{part}")
            except ImportError as exc:
                raise ImportError(f"implementation {name!r} has no {part!r} (attribute or submodule {name}.{part}); "
                                  f"expose the documented module there") from exc
        missing = [f for f in functions if not callable(getattr(sub, f, None))]
        if missing:
            raise ImportError(f"implementation {name!r}: {part} lacks {', '.join(missing)} (see the seed API pages)")
        found[part] = sub
    return types.SimpleNamespace(name=name, module=root, **found)
