"""Confinement of a rank's communication to its CP group: which calls leak, and why.

On a world mesh (``cp_harness.cases.meshes``) a rank's CP group is a few of the pool's ranks, and the
common CP bugs send traffic elsewhere: a collective on the default group or on another dimension's group,
a point-to-point peer addressed by its CP rank as if it were a global rank. ``leak(op, arguments, allowed)``
says, for one communication op as the dispatcher sees it (``cp_harness.instruments.comm_meter``), whether
it reaches a global rank outside ``allowed`` and how: a collective whose process group has a member outside,
a message to or from a peer outside (or to the rank itself, which gloo waits on forever). The meter raises ``CommLeak`` with that text before the call runs.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class UnknownGroup(Exception):
    """The meter cannot tell which process group a call ran on."""


class CommLeak(RuntimeError):
    """A communication call inside ``recording(allowed=...)`` would reach a rank outside the allowed ones."""


def process_group(a: dict):
    """The call's ``ProcessGroup`` (argument ``process_group`` or ``group_name``); ``UnknownGroup`` otherwise."""
    pg = a.get("process_group")
    try:
        if pg is None:
            name = a.get("group_name")
            if isinstance(name, dist.ProcessGroup):
                return name
            if isinstance(name, str):
                # torch types the name as its GroupName, a NewType of str: any str is one at run time
                return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]
            raise UnknownGroup(f"group_name is {type(name).__name__}")
        return pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)
    except UnknownGroup:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to resolve makes the call unaccounted
        raise UnknownGroup(f"{type(exc).__name__}: {exc}") from exc


def _members(pg) -> list[int]:
    """Global ranks of ``pg`` in group-rank order (the registered group of the same name when ``pg`` is a
    fresh wrapper of it)."""
    try:
        return list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a wrapper the registry does not know: look it up by name
        return list(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(pg.group_name)))


# Point-to-point ops: the argument naming the peer (a rank of the call's group), and the direction.
_PEER_ARGS = {
    "c10d::send": ("dst", "to"),
    "c10d::recv_": ("src", "from"),
    "_c10d_functional::isend": ("dst", "to"),
    "_c10d_functional::irecv": ("src", "from"),
}


def leak(name: str, a: dict[str, Any], allowed: frozenset[int]) -> str | None:
    """Why op ``name`` with named arguments ``a`` reaches a global rank outside ``allowed`` (``None``: it does not,
    or its group cannot be told, in which case the call is unaccounted instead)."""
    try:
        members = _members(process_group(a))
    except Exception:  # noqa: BLE001
        return None
    inside = f"this rank's CP group {sorted(allowed)}"
    if name in _PEER_ARGS or name == "_c10d_functional::batch_p2p_ops":
        peers = (
            [(a[_PEER_ARGS[name][0]], _PEER_ARGS[name][1])]
            if name in _PEER_ARGS
            else [(p, "to" if "send" in kind else "from") for kind, p in zip(a["op_list"], a["peer_list"])]
        )
        for peer, way in peers:
            target = members[int(peer)] if 0 <= int(peer) < len(members) else None
            if target == dist.get_rank():  # gloo waits forever on a message to itself
                return (
                    f"a point-to-point message {way} this rank itself (global rank {target}, peer {int(peer)} of "
                    f"a group of global ranks {members}): a peer computed from a CP rank taken as a global "
                    f"rank, or a global rank taken as a CP rank?"
                )
            if target not in allowed:
                return (
                    f"a point-to-point message {way} global rank {target} (peer {int(peer)} of a group of global "
                    f"ranks {members}) leaves {inside}: address a CP peer by its global rank "
                    f"(torch.distributed.get_global_rank(cp_group, cp_rank)), or by group_dst/group_src with "
                    f"group=cp_group; a CP rank passed as a global rank reaches another rank"
                )
        return None
    outside = sorted(set(members) - allowed)
    if not outside:
        return None
    return (
        f"{name} on a process group of global ranks {members} reaches ranks {outside} outside {inside}: run "
        f"CP collectives on the CP group (mesh.get_group()), not on the default group or another mesh "
        f"dimension's group"
    )
