"""Finding the implementation under test.

Any importable module that exposes ``inkling2`` and ``mistral_large4`` (as
submodules or plain attributes) with the documented functions can be judged.
The choice comes from ``--cp-impl`` / ``--impl`` (whose default, ``$CP_IMPL``, the
command line and the plugin read at their boundary: ``cp_harness.options``), else the
bundled ``cp_impl``. A comma-separated list
(``cp_impl,cp_impl.variants.load_balanced``) judges several implementations
in one run: the ranks load each, and every case that goes through a sharder
draws one of them (the case's ``"impl"`` key); the first is the primary one,
used where a case names none.
"""

from __future__ import annotations

import importlib
import types

DEFAULT_IMPL = "cp_impl"

REQUIRED = {
    "inkling2": (
        "convolution_history",
        "gather_sequence",
        "prepare_cp_inputs",
        "unpack_row_layout",
        "validate_document_positions",
    ),
    "mistral_large4": ("gather_tokens", "prepare_cp_inputs", "prepare_packed_cp_inputs", "shifted_cp_loss"),
}


def selected_impl_name(explicit: str | None = None) -> str:
    """The module name(s) to judge: ``explicit``, else ``cp_impl`` (comma-separated when several)."""
    return explicit or DEFAULT_IMPL


def impl_names(selection: str) -> tuple[str, ...]:
    """The module names of a selection (``"a,b"`` -> ``("a", "b")``); ``ValueError`` when it names none."""
    names = tuple(dict.fromkeys(part.strip() for part in selection.split(",") if part.strip()))
    if not names:
        raise ValueError(f"{selection!r}: name at least one implementation module, e.g. cp_impl")
    return names


def primary_impl(selection: str) -> str:
    """The first module of a selection: the one a case without an ``"impl"`` key runs."""
    return impl_names(selection)[0]


def case_impl(case: dict, selection: str) -> str:
    """The implementation a case runs: its ``"impl"`` key, else the selection's primary module."""
    return case.get("impl") or primary_impl(selection)


def load_impl(name: str | None = None) -> types.SimpleNamespace:
    """Import the implementation and return ``namespace(name, inkling2, mistral_large4)``.

    ``name``: one module (of a selection, the primary one). Raises
    ``ImportError`` naming the missing module or function.
    """
    name = primary_impl(selected_impl_name(name))
    root = importlib.import_module(name)
    found = {}
    for part, functions in REQUIRED.items():
        sub = getattr(root, part, None)
        if sub is None:
            try:
                sub = importlib.import_module(f"{name}.{part}")
            except ImportError as exc:
                raise ImportError(
                    f"implementation {name!r} has no {part!r} (attribute or submodule {name}.{part}); "
                    f"expose the documented module there"
                ) from exc
        missing = [f for f in functions if not callable(getattr(sub, f, None))]
        if missing:
            raise ImportError(f"implementation {name!r}: {part} lacks {', '.join(missing)} (see the seed API pages)")
        found[part] = sub
    return types.SimpleNamespace(name=name, module=root, **found)
