"""The one writer of standalone repros: a ``Plan`` (docstring, constants, functions, arrays) becomes ``NAME.py`` and
``NAME.npz`` beside it.

The script is the plan's docstring, the standard imports, its constants (the arrays' file name and SHA-256
among them), the shared parts (``parts``: launching ranks, reading arrays, comparing) and the family's
functions, copied from their source: code that runs in the harness's own tests, not text assembled from
templates. The arrays are written as a pickle-free ``.npz`` whose bytes depend on the arrays alone (fixed zip
entry dates), so exporting the same case twice writes the same files. Tensors go in with ``Plan.add``:
bfloat16 widened to float32 (exact; the array ``bfloat16`` lists them), a permuted view stored in memory order with its
permutation (the script views it back with the recorded strides).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import os
import re
import textwrap
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cp_harness.cases.meshes import MeshLayout
from cp_harness.instruments.coverage import memory_order
from cp_harness.repro import parts

LINE = 116
SCRIPT = "@SCRIPT@"  # stands for the script's file name in a plan's docstring
_STANDARD = ("argparse", "datetime", "hashlib", "importlib", "io", "os", "socket", "sys", "traceback")
_SHARED = (parts.main, parts.rank_main, parts.load_arrays, parts.tensor, parts.differs)


class NotExportable(Exception):
    """A failing case whose kind has no standalone script (yet); the message says why."""


@dataclasses.dataclass
class Plan:
    """A repro before it is written. ``name``: the file stem; ``doc``: the docstring's paragraphs (what it checks,
    in words a maintainer can act on; how to run it); ``world``: the CP size; ``mesh``: whether the calls get a
    CP mesh (``False``: ``mesh=None``), or the world mesh whose ``mesh["cp"]`` they get (``on_world_mesh``);
    ``constants``: the family's, written as literals in this order;
    ``functions``: the family's (callables, their source copied, or source text); ``imports``: the code under
    test's own import lines; ``arrays``: what ``NAME.npz`` holds (see ``add``)."""

    name: str
    doc: list[str]
    world: int
    mesh: bool | dict = True
    constants: dict[str, Any] = dataclasses.field(default_factory=dict)
    functions: list[Callable | str] = dataclasses.field(default_factory=list)
    imports: list[str] = dataclasses.field(default_factory=list)
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    widened: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout: int = 120
    arithmetic: bool = False  # some value is compared within a ULP budget (the script holds ``parts.beyond``)

    def add(self, name: str, value, strides: bool = False) -> None:
        """Store ``value`` (a tensor or array) under ``name``, as the script's ``tensor`` reads it back (``strides``:
        a permuted view keeps its strides; else its values are stored as they are ordered)."""
        if not isinstance(value, torch.Tensor):
            self.arrays[name] = np.asarray(value)
            return
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            self.widened[name] = "bfloat16"
            value = value.float()
        order = memory_order(value) if strides else None
        if order is not None:
            self.arrays["memory_order/" + name] = np.asarray(order, dtype=np.int64)
            value = value.permute(*order)
        self.arrays[name] = value.contiguous().numpy().copy()


def on_world_mesh(plan: Plan, case: dict) -> Plan:
    """``plan`` run as ``case`` ran: on ``mesh["cp"]`` of the world mesh its ``mesh_layout`` names (every rank of
    the mesh started, each CP group that ran the case running it), or as it is for a case without one."""
    layout = MeshLayout.of(case)
    if layout is None:
        return plan
    groups = [list(layout.groups()[g]) for g in layout.running()]
    doc = [*plan.doc[:-1], f"The ranks form the world mesh {layout.label()} (DeviceMesh, mesh_dim_names "
           f"{list(layout.dims)}), as training builds it; each CP group of global ranks {groups} runs the case on "
           'mesh["cp"], and "rank" below is the rank in that group.', plan.doc[-1]]
    mesh = {"dims": list(layout.dims), "shape": list(layout.shape), "ranks": list(layout.ranks), "groups": groups}
    return dataclasses.replace(plan, doc=doc, mesh=mesh)


def _literal(value: Any) -> str:
    text = repr(value)
    if len(text) <= LINE - 20 or not isinstance(value, (list, tuple, dict)):
        return text
    if isinstance(value, dict):
        items = [f"    {k!r}: {v!r}," for k, v in value.items()]
        return "{\n" + "\n".join(items) + "\n}"
    return "[\n" + "\n".join(f"    {v!r}," for v in value) + "\n]"


def _source(fn: Callable | str) -> str:
    """A function's source as the script holds it: without the linter and type checker notes it needs in the
    harness, where it refers to names only the script defines."""
    source = textwrap.dedent(fn if isinstance(fn, str) else inspect.getsource(fn)).strip("\n")
    return re.sub(r"  # (noqa|type: ignore)[^\n]*", "", source)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as ``.npz`` bytes that depend on the arrays alone (no object arrays: nothing to unpickle)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(arrays):
            entry = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            entry.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(entry, "w") as f:
                np.lib.format.write_array(f, np.asarray(arrays[name]).copy(order="C"), allow_pickle=False)
    return buffer.getvalue()


def _docstring(paragraphs: list[str]) -> str:
    out = []
    for p in paragraphs:
        if p.startswith("    ") or "\n" in p:  # a command or a preformatted block: as it is
            out.append(p)
        else:
            out.append(textwrap.fill(p, LINE, break_long_words=False, break_on_hyphens=False))
    return '"""' + "\n\n".join(out).replace('"""', "'''") + '\n"""'


def text(plan: Plan, sha256: str) -> str:
    """The script of ``plan`` whose arrays have digest ``sha256`` (``SCRIPT`` in its docstring: its file name)."""
    world = isinstance(plan.mesh, dict)  # on a world mesh: every rank of it, the case on its CP groups
    ranks = max(plan.mesh["ranks"]) + 1 if isinstance(plan.mesh, dict) else plan.world
    constants = {"WORLD": plan.world, "RANKS": ranks, "MESH": plan.mesh, "TIMEOUT": plan.timeout}
    if plan.arrays:
        constants.update(ARRAYS=f"{plan.name}.npz", SHA256=sha256)
    constants.update(plan.constants)
    third = [line for line in plan.imports if line.split()[1].split(".")[0] == "nemo_automodel"]
    needed = [m for m in _STANDARD if plan.arrays or m not in ("hashlib", "io")]
    standard = sorted({f"import {m}" for m in needed} | (set(plan.imports) - set(third)),
                      key=lambda line: (line.startswith("from"), line))
    head = [_docstring([p.replace(SCRIPT, f"{plan.name}.py") for p in plan.doc]), "", *standard, "",
            "import numpy as np", "import torch", "import torch.distributed as dist",
            f"from torch.distributed.device_mesh import {'DeviceMesh' if world else 'init_device_mesh'}", *third, ""]
    body = [f"{k} = {_literal(v)}" for k, v in constants.items()]
    shared = [*(_SHARED if plan.arrays else _SHARED[:2]), *([parts.beyond] if plan.arithmetic else [])]
    blocks = [_source(f) for f in [*shared, *plan.functions]]
    if world:  # the script holds the world-mesh variant, under the name rank_main
        blocks[1] = re.sub(r"^def rank_main_on_world_mesh", "def rank_main", _source(parts.rank_main_on_world_mesh))
    tail = 'if __name__ == "__main__":\n    sys.exit(main())\n'
    return "\n".join(head) + "\n" + "\n".join(body) + "\n\n\n" + "\n\n\n".join(blocks) + "\n\n\n" + tail


def write(plan: Plan, directory: str, name: str | None = None) -> str:
    """Write ``NAME.py`` and ``NAME.npz`` into ``directory`` (created; ``name``: instead of the plan's); the
    script's path."""
    if name:
        plan = dataclasses.replace(plan, name=name)
    os.makedirs(directory, exist_ok=True)
    data = npz_bytes({**plan.arrays, **({"bfloat16": np.array(sorted(plan.widened))} if plan.widened else {})})
    if plan.arrays:  # a script that builds everything itself (a real model) has none
        with open(os.path.join(directory, f"{plan.name}.npz"), "wb") as f:
            f.write(data)
    path = os.path.join(directory, f"{plan.name}.py")
    with open(path, "w") as f:
        f.write(text(plan, hashlib.sha256(data).hexdigest()))
    return path
