"""Check ``cp_attention``: a framework's own CP attention function, called on every rank as its training code calls
it, against float64 attention on one device: the output and the gradients of the query and of every key / value
block.

The function comes from an *attention subject* (case key ``subject``: a module path; the interface is
``examples/automodel/attention/__init__.py``): its sharding of the sequence (``local_positions``), its call
(``attention``) and the kernel stand-ins it needs on the rank's device (``STANDINS``, entered around every call,
the one-rank baseline's too: ``flash_attn_cpu`` stands for a kernel the CPU has none of). What is computed is the
EAGLE-3 mixed attention (``components/speculative/eagle``): query ``t`` attends, in one softmax, the block-0 keys
``j <= t`` of its own document and, for each later TTT block ``i >= 1``, the single key ``k_i[t]`` (value
``v_i[t]``), all scores scaled by ``head_dim ** -0.5``.

Every rank draws the same global float64 ``q [B, S, H, D]``, ``k``, ``v [blocks, B, S, H, D]`` and upstream
gradient ``dout [B, S, H, D]`` from the seed, rounds them to the case's dtype (the oracle sees the rounded values),
takes its shard at the subject's index map (and, where the subject names it, runs the framework trainer's own TTT left
shift, ``trainer_shift``, on its shard of ``1..S``: put back in global order it must be the global left shift, bit
for bit, so the index map is the layout the training code assumes), calls the function with ``q`` and the lists of its blocks as leaves,
backpropagates ``dout``'s shard, and returns its output and gradients with its index map. The judge puts them back in
global order (an index map that does not own every position once is a problem naming the positions), compares each
tensor with the float64 oracle within the dtype's ULP budget (``BUDGETS``, at the tensor's largest value), and, at
``N > 1``, the excess judge holds each tensor to ``c x`` the error of the same subject on one rank ``+ floor``
(``cp_harness.judging.excess``): what CP adds over one device, from the measured spread. Failure messages name how
many elements differ, the worst, its global position, owning rank and distance to a shard boundary.

Case keys: ``subject``, ``dtype`` (the subject's ``DTYPES``), ``world_size``, ``seed``, ``batch`` (``B``),
``seq_len`` (``S``, a multiple of ``subject.seq_multiple(N)``), ``heads``, ``head_dim``, ``blocks`` (TTT blocks,
``>= 1``), ``documents`` (optional, packed subjects only, ``B = 1``: document lengths summing to ``S``). A case the
subject cannot take is refused on every rank before any collective (``validate``'s ``ValueError``, naming the key
and the fix), and the report has one problem per rank saying so; no rank raises, so the pool stays warm.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from cp_harness import standins
from cp_harness.cases.descriptions import dtype_of, random_tensor
from cp_harness.checks import register
from cp_harness.judging.budgets import Budget
from cp_harness.judging.compare import TokenGrid, compare_exact, compare_ulp
from cp_harness.judging.verdicts import CaseReport
from oracle.attention import allowed_keys

# Element-wise, at the tensor's largest value (floor fraction 1). The CPU stand-in rounds once per block; one rank
# then errs by a few ULPs (docs/real_clients.md, "The EAGLE-3 CP attention", measured); the excess judge carries the
# CP-versus-one-rank comparison.
BUDGETS = {"bfloat16": Budget(8.0, 1.0), "float16": Budget(8.0, 1.0)}
KEYS = ("subject", "dtype", "world_size", "seed", "batch", "seq_len", "heads", "head_dim", "blocks")


def load_subject(name: str):
    """The attention subject module ``name`` (an import error names it)."""
    return importlib.import_module(name)


def validate(case: dict, subject) -> None:
    """``ValueError`` naming the case key and the fix, for a case the subject cannot take."""
    missing = [k for k in KEYS if k not in case]
    if missing:
        raise ValueError(f"cp_attention case lacks {missing}; give every key of {list(KEYS)}")
    n, s, b, h = (int(case[k]) for k in ("world_size", "seq_len", "batch", "heads"))
    if case["dtype"] not in subject.DTYPES:
        raise ValueError(f"dtype={case['dtype']!r}: {subject.NAME} runs {list(subject.DTYPES)}")
    if s < 1 or s % subject.seq_multiple(n):
        raise ValueError(
            f"seq_len={s}: {subject.NAME} at world_size={n} needs a positive multiple of "
            f"{subject.seq_multiple(n)} (the framework's divisibility rule); round seq_len up"
        )
    if b not in getattr(subject, "BATCH_SIZES", (b,)) or b < 1:
        raise ValueError(f"batch={b}: {subject.NAME} takes batch in {list(getattr(subject, 'BATCH_SIZES', ()))}")
    if getattr(subject, "HEADS_DIVISIBLE", False) and h % n:
        raise ValueError(f"heads={h}: {subject.NAME} splits heads over world_size={n}; use a multiple of {n}")
    if int(case["blocks"]) < 1 or h < 1 or int(case["head_dim"]) < 1:
        raise ValueError("blocks, heads and head_dim must be >= 1")
    docs = case.get("documents")
    if docs is not None:
        if not subject.PACKED:
            raise ValueError(f"documents: {subject.NAME} takes no packed sequences (the recipe refuses them); drop it")
        if b != 1 or sum(docs) != s or min(docs) < 1:
            raise ValueError(f"documents={docs}: give positive lengths summing to seq_len={s}, with batch=1")


def inputs(case: dict) -> dict[str, torch.Tensor]:
    """The global ``q``, ``k``, ``v``, ``dout`` in the case's dtype (shapes in the module docstring)."""
    b, s, h, d, n = (int(case[k]) for k in ("batch", "seq_len", "heads", "head_dim", "blocks"))
    dtype = dtype_of(case)
    return {
        "q": random_tensor(case, "q", (b, s, h, d), dtype=dtype),
        "k": random_tensor(case, "k", (n, b, s, h, d), dtype=dtype),
        "v": random_tensor(case, "v", (n, b, s, h, d), dtype=dtype),
        "dout": random_tensor(case, "dout", (b, s, h, d), dtype=dtype),
    }


def cu_seqlens(case: dict) -> torch.Tensor | None:
    """The GLOBAL document boundaries ``[docs + 1]`` int32 of a packed case (``None``: one causal stream)."""
    docs = case.get("documents")
    return None if docs is None else torch.tensor([0, *np.cumsum(docs).tolist()], dtype=torch.int32)


def _rank(case: dict, ctx) -> tuple[dict, dict]:
    subject = load_subject(case["subject"])
    try:
        validate(case, subject)
    except ValueError as exc:  # every rank refuses the same case before any collective; the judge names each
        return {"refused": f"ValueError: {exc}"}, {}
    x = inputs(case)
    index = subject.local_positions(int(case["seq_len"]), ctx.cp_size, ctx.rank).to(torch.long)
    q = x["q"].index_select(1, index).to(ctx.device).requires_grad_(True)
    ks = [t.index_select(1, index).to(ctx.device).requires_grad_(True) for t in x["k"]]
    vs = [t.index_select(1, index).to(ctx.device).requires_grad_(True) for t in x["v"]]
    group = ctx.mesh.get_group()
    extra = {}
    if hasattr(subject, "trainer_shift"):  # the training code's own assumption about this layout
        tokens = torch.arange(1, int(case["seq_len"]) + 1).unsqueeze(0)
        extra["shift"] = subject.trainer_shift(tokens.index_select(1, index).to(ctx.device).contiguous(), group)
    cu = cu_seqlens(case)
    with standins.entered(subject.STANDINS, ctx.device.type) as stood_in:
        out = subject.attention(
            q, ks, vs, group, int(case["head_dim"]) ** -0.5, None if cu is None else cu.to(ctx.device)
        )
        out.backward(x["dout"].index_select(1, index).to(ctx.device))
    nan = float("nan")
    grads = {
        "dq": q.grad if q.grad is not None else torch.full_like(q, nan),
        "dk": torch.stack([t.grad if t.grad is not None else torch.full_like(t, nan) for t in ks]),
        "dv": torch.stack([t.grad if t.grad is not None else torch.full_like(t, nan) for t in vs]),
    }
    info = {"standins": stood_in.used(), "out_dtype": str(out.dtype)}
    return info, {"out": out.detach(), **grads, "index": index, **extra}


def reference(case: dict) -> dict[str, torch.Tensor]:
    """The float64 oracle: ``out [B, S, H, D]``, ``dq``, ``dk`` / ``dv [blocks, B, S, H, D]`` of the joint softmax
    (module docstring) with upstream ``dout``, from the case's rounded inputs."""
    x = {k: v.to(torch.float64) for k, v in inputs(case).items()}
    q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    b, s = q.shape[:2]
    scale = int(case["head_dim"]) ** -0.5
    docs = case.get("documents")
    ids = torch.zeros(b, s, dtype=torch.long)
    if docs is not None:
        ids[0] = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    allowed = allowed_keys(torch.ones(b, s, dtype=torch.bool), ids)  # [B, S, S]
    block0 = torch.einsum("bqhd,bkhd->bhqk", q, k[0]) * scale
    block0 = block0.masked_fill(~allowed[:, None], float("-inf"))
    diagonal = torch.einsum("bshd,nbshd->bhsn", q, k[1:]) * scale  # [B, H, S, blocks - 1]
    probs = torch.softmax(torch.cat([block0, diagonal], dim=-1), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :s], v[0]) + torch.einsum(
        "bhsn,nbshd->bshd", probs[..., s:], v[1:]
    )
    out.backward(x["dout"])
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _expect(case: dict) -> dict:
    return {name: t.numpy() for name, t in reference(case).items()}


def _global(outputs: list, name: str, axis: int, seq_len: int) -> np.ndarray:
    """Every rank's local ``name`` put back in global order along ``axis`` by its index map."""
    first = outputs[0].tensors[name]
    shape = list(first.shape)
    shape[axis] = seq_len
    out = np.full(shape, np.nan, dtype=np.float64)
    for o in outputs:
        index = np.asarray(o.tensors["index"]).astype(np.int64)
        where = [slice(None)] * len(shape)
        where[axis] = index  # type: ignore[call-overload]
        out[tuple(where)] = o.tensors[name]
    return out


def _evaluate(case: dict, outputs: list, expected: dict, policy) -> CaseReport:
    report = CaseReport(case=case, standins=dict(outputs[0].info.get("standins", {})))
    refused = [o for o in outputs if "refused" in o.info]
    for o in refused:
        report.problem(f"rank {o.rank} refused the case: {o.info['refused']}", rank=o.rank)
    if refused:
        return report
    dtype, s, n = case["dtype"], int(case["seq_len"]), int(case["world_size"])
    maps = [np.asarray(o.tensors["index"]).astype(np.int64) for o in outputs]
    owned = np.concatenate(maps)
    counts = np.bincount(owned[(owned >= 0) & (owned < s)], minlength=s)
    if owned.size != s or (counts != 1).any() or ((owned < 0) | (owned >= s)).any():
        wrong = [int(p) for p in np.flatnonzero(counts != 1)[:8]]
        report.problem(
            f"the subject's index maps do not own every global position of [0, {s}) exactly once (positions "
            f"{wrong} owned {[int(counts[p]) for p in wrong]} times; maps {[m.tolist() for m in maps]})"
        )
        return report
    for o in outputs:
        report.require(
            o.info["out_dtype"] == f"torch.{dtype}", f"rank {o.rank}: output dtype {o.info['out_dtype']}, not {dtype}"
        )
    grid = TokenGrid.from_index_maps(maps, s)
    budget = policy.budget(CP_ATTENTION, dtype)
    blocks = int(case["blocks"])
    tensors: list[tuple[str, np.ndarray, np.ndarray, bool]] = [
        ("attention output", _global(outputs, "out", 1, s), expected["out"], False),
        ("dq", _global(outputs, "dq", 1, s), expected["dq"], True),
    ]
    for name in ("dk", "dv"):
        whole = _global(outputs, name, 2, s)
        for i in range(blocks):
            label = f"{name} block {i} ({'ring / all-to-all' if i == 0 else 'TTT diagonal'})"
            tensors.append((label, whole[i], expected[name][i], True))
    for label, actual, want, gradient in tensors:
        report.add(
            compare_ulp(
                label,
                actual,
                want,
                budget_ulp=budget.ulp,
                floor_fraction=budget.floor_fraction,
                grid=grid,
                ulp_dtype=dtype,
                gradient=gradient,
            )
        )
    if "shift" in outputs[0].tensors:
        tokens = np.arange(1, s + 1, dtype=np.int64)[None]
        want = np.concatenate([tokens[:, 1:], np.zeros((1, 1), dtype=np.int64)], axis=1)
        report.add(
            compare_exact(
                "trainer's TTT left shift on this layout",
                _global(outputs, "shift", 1, s).astype(np.int64),
                want,
                grid=grid,
            )
        )
    report.info["ulp"] = report.max_ulp
    report.info["cp_size"] = n
    return report


def cases(subject_name: str, world_sizes: tuple[int, ...] | None = None, dtype: str | None = None):
    """A Hypothesis strategy of cases for the subject ``subject_name`` (imports it): CP sizes of its
    ``WORLD_SIZES`` (those in ``world_sizes`` when given), its ``DTYPES`` (or ``dtype``), ``S`` up to 24, one or
    two rows, 1-3 heads (``N`` or ``2N`` where heads are split), head dim 4 or 8, 1-3 TTT blocks, packed documents
    (1-4, single tokens included) half of the time where the subject takes them."""
    subject = load_subject(subject_name)
    sizes = [n for n in subject.WORLD_SIZES if world_sizes is None or n in world_sizes]
    dtypes = [d for d in subject.DTYPES if dtype is None or d == dtype]
    if not sizes or not dtypes:
        raise ValueError(f"{subject.NAME} runs CP sizes {list(subject.WORLD_SIZES)}, dtypes {list(subject.DTYPES)}")

    @st.composite
    def draw(draw) -> dict:
        n = draw(st.sampled_from(sizes + [n for n in sizes if n > 1]))  # CP > 1 twice as often as one rank
        multiple = subject.seq_multiple(n)
        s = multiple * draw(st.integers(1, max(1, 24 // multiple)))
        b = draw(st.sampled_from(getattr(subject, "BATCH_SIZES", (1, 2))))
        heads = n * draw(st.integers(1, 2)) if getattr(subject, "HEADS_DIVISIBLE", False) else draw(st.integers(1, 3))
        case: dict[str, Any] = {
            "check": "cp_attention",
            "subject": subject_name,
            "dtype": draw(st.sampled_from(dtypes)),
            "world_size": n,
            "seed": draw(st.integers(0, 999)),
            "batch": b,
            "seq_len": s,
            "heads": heads,
            "head_dim": draw(st.sampled_from((4, 8))),
            "blocks": draw(st.integers(1, 3)),
        }
        if subject.PACKED and b == 1 and draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, s - 1), max_size=3))) if s > 1 else []
            case["documents"] = [e - a for a, e in zip([0, *cuts], [*cuts, s])]
        return case

    return draw()


def smoke_cases(subject_name: str) -> list[dict]:
    """Two named cases per subject for the default command: CP 2 float16 (one TTT block) and CP 3 bfloat16 (three
    blocks; packed where the subject takes documents); two heads per rank where the subject splits heads."""
    subject = load_subject(subject_name)
    out = []
    for n, dtype, blocks in ((2, "float16", 1), (3, "bfloat16", 3)):
        heads = 2 * n if getattr(subject, "HEADS_DIVISIBLE", False) else 2  # two heads per rank: their order shows
        case = {
            "check": "cp_attention",
            "subject": subject_name,
            "dtype": dtype,
            "world_size": n,
            "seed": 7 + n,
            "batch": 1,
            "seq_len": 4 * subject.seq_multiple(n),
            "heads": heads,
            "head_dim": 8,
            "blocks": blocks,
        }
        if subject.PACKED and n == 3:
            case["documents"] = [5, 1, 6]
        out.append(case)
    return out


CP_ATTENTION = register(
    "cp_attention",
    rank=_rank,
    evaluate=_evaluate,
    expect=_expect,
    arithmetic=True,
    budgets=BUDGETS,
)
