"""Whether every rank of a case could build what the case needs, agreed before any collective of the CP path
(the real-model and training-step checks): one rank's failure is then named by that rank on every rank instead of
hanging its peers in a collective, and answered as a refusal that leaves the pool up."""

from __future__ import annotations

import torch

from cp_harness.judging.verdicts import CaseReport, ProblemKind


def agree_ready(ctx, error: BaseException | None) -> None:
    """Every rank of the case says whether it could build its model and batch before any collective of the CP
    path, so that one rank's failure is named by that rank instead of hanging the others."""
    group = ctx.mesh.get_group() if ctx.mesh is not None and ctx.cp_size > 1 else None
    if group is None:
        if error is not None:
            raise error
        return
    errors: list = [None] * ctx.cp_size
    mine = None if error is None else f"{type(error).__name__}: {error}"
    torch.distributed.all_gather_object(errors, mine, group=group)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        named = "; ".join(f"rank {r} raised {e}" for r, e in failed.items())
        raise RuntimeError(
            f"building the model or batch failed on rank(s) {sorted(failed)} ({named}); "
            f"rank {ctx.rank} did not run the case"
        ) from error


def refusal(ctx, error: BaseException | None) -> dict | None:
    """``agree_ready`` as an answer: ``None`` when every rank of the case is ready, else the info every rank returns,
    ``{"refused": "RuntimeError: building the model or batch failed on rank(s) [...] (...)"}``. Nothing of the CP
    path has run, so the ranks stay usable: returned, not raised (a raise restarts the pool, 20-40 s of a start with
    the framework's models preloaded on this machine, paid by the next case)."""
    try:
        agree_ready(ctx, error)
    except Exception as exc:  # noqa: BLE001 - the same verdict on every rank of the case
        return {"refused": f"{type(exc).__name__}: {exc}"}
    return None


def report_refusal(report: CaseReport, outputs: list) -> bool:
    """Record each rank's refusal (``refusal``) as the problem ``rank r raised: ...``; ``True`` if any refused."""
    refused = [o for o in outputs if "refused" in o.info]
    for o in refused:
        report.problem(f"rank {o.rank} raised: {o.info['refused']}", rank=o.rank, kind=ProblemKind.RANK_RAISED)
    return bool(refused)
