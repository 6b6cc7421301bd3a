"""Resolve a one-dimensional CP mesh to (size, rank, group).

Private helper shared by every multi-rank function of :mod:`cp_impl`.
``None`` or a mesh of size 1 means one rank: callers must then run no
collective at all.  CP rank ``i`` is process-group rank ``i`` of the mesh's
group (what ``DeviceMesh.get_local_rank`` reports); peers are addressed by
their global rank through ``torch.distributed.get_global_rank``, so meshes
over subgroups (global rank != CP rank) work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CPMesh", "resolve_mesh"]


@dataclass(frozen=True)
class CPMesh:
    """One rank's view of a CP mesh.

    ``size``: number of CP ranks ``N``; ``rank``: this rank ``r``;
    ``group``: the mesh's process group (``None`` when ``size == 1``);
    ``device_type``: the mesh's device type (``"cpu"``, ``"cuda"``, ...).
    """

    size: int
    rank: int
    group: Any
    device_type: str

    @property
    def single(self) -> bool:
        """True when there is one rank and no collective may run."""
        return self.size == 1

    def global_rank(self, cp_rank: int) -> int:
        """Global rank of CP rank ``cp_rank`` (for point-to-point peers)."""
        return dist.get_global_rank(self.group, cp_rank)

    def handshake_device(self, tensor: Any) -> torch.device:
        """Device for small control buffers: the input's device, else the mesh's."""
        if isinstance(tensor, torch.Tensor):
            return tensor.device
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)


_ONE_RANK = CPMesh(size=1, rank=0, group=None, device_type="cpu")


def resolve_mesh(mesh: Any, name: str = "mesh") -> CPMesh:
    """Return ``CPMesh`` for ``mesh`` (a 1-D ``DeviceMesh`` or ``None``).

    Raises ``TypeError`` when ``mesh`` is not a DeviceMesh-like object and
    ``ValueError`` when it is not one-dimensional; the message names the
    parameter ``name``.  Both depend only on the mesh, which is the same on
    every rank, so they are raised before any collective.
    """
    if mesh is None:
        return _ONE_RANK
    required = ("ndim", "size", "get_group", "get_local_rank")
    if not all(hasattr(mesh, attr) for attr in required):
        raise TypeError(
            f"{name}: expected a one-dimensional torch.distributed.device_mesh.DeviceMesh "
            f"or None, got {type(mesh).__name__}; pass the CP sub-mesh, e.g. "
            f'world_mesh["cp"], or None for a single rank'
        )
    if mesh.ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(
            f"{name}: expected a one-dimensional CP mesh, got a {mesh.ndim}-D mesh "
            f'(dims {names}); pass the CP sub-mesh, e.g. world_mesh["cp"]'
        )
    size = int(mesh.size())
    if size == 1:
        return CPMesh(size=1, rank=0, group=None, device_type=str(mesh.device_type))
    return CPMesh(
        size=size,
        rank=int(mesh.get_local_rank()),
        group=mesh.get_group(),
        device_type=str(mesh.device_type),
    )
