"""Hypothesis strategies for CP cases.

Small composable families over the case space (``cp_harness.cases.profiles.CaseSpace``: CP sizes, dtypes,
implementations, passed to every strategy or read from the loaded case-space profile), payload
dtypes, layouts (packed THD rows, padded BSHD rows), images placed on real
tokens, and world meshes as training builds them (``mesh_layouts``, ``with_mesh_layout``: the extra
``mesh_layout`` key of ``cp_harness.cases.meshes``; a case drawn without it is today's case). Each check's own strategy, which yields a complete case description
(``cp_harness.cases.descriptions``), lives in the check's module and is built
from these. The tensors themselves are not drawn: each case carries a seed and
is rebuilt deterministically on every rank, so what Hypothesis shrinks is the
structure (lengths, layout, CP size), which is what CP bugs depend on.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from cp_harness.cases import meshes, profiles
from cp_harness.cases.descriptions import PATCH_SIZE, spec_layout
from cp_harness.cases.profiles import (  # noqa: F401 - the case space's vocabulary, used with the strategies
    ALL_DTYPES,
    CI_FULL_WEIGHT_MAX_SIZE,
    DEFAULT_WORLD_SIZES,
    FLOAT_DTYPES,
    VALUE_DTYPES,
    CaseSpace,
)

seeds = st.integers(min_value=0, max_value=2**31 - 1)


def as_space(space) -> CaseSpace | None:
    """``None`` (the session's, read when drawn), a ``CaseSpace``, or a sequence of CP sizes (the session's
    dtypes and implementations with these sizes)."""
    if space is None or isinstance(space, CaseSpace):
        return space
    return dataclasses.replace(profiles.current_space(), world_sizes=tuple(space), favour_small=False)


def _resolved(space: CaseSpace | None) -> CaseSpace:
    return space if space is not None else profiles.current_space()


def float_dtypes(allowed=FLOAT_DTYPES, space: CaseSpace | None = None) -> st.SearchStrategy[str]:
    """A floating dtype among ``allowed`` and the space's (all four by default, equally likely)."""

    def pick():
        chosen = tuple(d for d in allowed if d in _resolved(space).dtypes)
        return st.sampled_from(chosen) if chosen else st.nothing()

    return st.deferred(pick)


def payload_dtypes(space: CaseSpace | None = None) -> st.SearchStrategy[str]:
    """A data-movement payload: a float dtype two times in three, else an integer or bool payload."""

    def pick():
        dtypes = _resolved(space).dtypes
        floats = tuple(d for d in FLOAT_DTYPES if d in dtypes)
        others = tuple(d for d in dtypes if d not in FLOAT_DTYPES)
        if floats and others:
            return st.one_of(st.sampled_from(floats), st.sampled_from(floats), st.sampled_from(others))
        return st.sampled_from(floats or others)

    return st.deferred(pick)


def with_payload(case: dict, name: str) -> dict:
    """Write a drawn payload dtype into a case: ``dtype`` for a float, else ``value_dtype`` (``dtype`` stays float64)."""
    if name in FLOAT_DTYPES:
        case["dtype"] = name
    else:
        case["dtype"], case["value_dtype"] = "float64", name
    return case


@st.composite
def with_impl(draw, case: dict, space: CaseSpace | None = None) -> dict:
    """``case`` with an ``"impl"`` drawn from the space's implementations (unchanged when one is judged)."""
    impls = _resolved(space).impls
    if len(impls) > 1:
        case = {**case, "impl": draw(st.sampled_from(impls))}
    return case


def world_sizes(space: CaseSpace | None = None) -> st.SearchStrategy[int]:
    """A CP size of ``space`` (default: the session's, read when drawn)."""
    if space is not None:
        return st.sampled_from(space.size_draws)
    return st.deferred(lambda: st.sampled_from(profiles.current_space().size_draws))


@st.composite
def packed_row(draw, seq_len: int) -> list[list[int]]:
    """One THD row: ``[[real, padded], ...]`` with ``sum(padded) <= seq_len``.

    Includes one-token and empty documents, per-document padding and tail padding.
    """
    docs: list[list[int]] = []
    used = 0
    # A row with no document at all (all tail padding) is kept, but rare: it makes every loss zero.
    if draw(st.sampled_from((False,) * 9 + (True,))):  # (integers favour 0: it would not be rare)
        return docs
    max_docs = draw(st.integers(min_value=1, max_value=6))
    for _ in range(max_docs):
        room = seq_len - used
        if room <= 0:
            break
        # An empty document only after a real one: a row of empty documents is the rare branch above.
        kind = draw(st.sampled_from(("any", "any", "one", "empty", "fill") if docs else ("any", "any", "one", "fill")))
        if kind == "one":
            real = 1
        elif kind == "empty":
            real = 0
        elif kind == "fill":
            real = room
        else:
            real = draw(st.integers(min_value=1, max_value=room))
        padded = real + draw(st.integers(min_value=0, max_value=min(3, room - real)))
        if padded == 0 and kind == "empty":
            padded = min(room, draw(st.integers(min_value=0, max_value=2)))
        docs.append([real, padded])
        used += padded
    return docs


@st.composite
def packed_layout(draw, min_len: int = 1, max_len: int = 40, max_rows: int = 3, rows: int | None = None) -> dict:
    """A THD batch description ``{"format": "thd", "seq_len", "docs"}``."""
    seq_len = draw(st.integers(min_value=min_len, max_value=max_len))
    n_rows = rows if rows is not None else draw(st.integers(min_value=1, max_value=max_rows))
    docs = [draw(packed_row(seq_len)) for _ in range(n_rows)]
    return {"format": "thd", "seq_len": seq_len, "docs": docs}


@st.composite
def padded_layout(draw, min_len: int = 1, max_len: int = 40, max_rows: int = 3) -> dict:
    """A BSHD batch description with left, right, two-sided or full padding per row."""
    seq_len = draw(st.integers(min_value=min_len, max_value=max_len))
    rows = []
    for _ in range(draw(st.integers(min_value=1, max_value=max_rows))):
        # All-padding rows kept but rarer (one in nine): they make every loss and gradient zero.
        style = draw(st.sampled_from(("none", "left", "right", "both", "left", "right", "both", "none", "all")))
        if style == "all":
            rows.append([0, 0])
            continue
        real = draw(st.integers(min_value=1, max_value=seq_len))
        room = seq_len - real
        left = {"none": 0, "left": room, "right": 0}.get(style, 0)  # "both": drawn below
        if style == "none":
            real, left = seq_len, 0
        elif style == "both":
            left = draw(st.integers(min_value=0, max_value=room))
        rows.append([left, real])
    return {"format": "bshd", "seq_len": seq_len, "rows": rows}


def layouts(min_len: int = 1, max_len: int = 40, max_rows: int = 3) -> st.SearchStrategy[dict]:
    return st.one_of(packed_layout(min_len, max_len, max_rows), padded_layout(min_len, max_len, max_rows))


@st.composite
def with_extras(draw, layout_strategy: st.SearchStrategy[dict]) -> dict:
    """A layout plus, sometimes, real EOS tokens equal to the pad id."""
    spec = draw(layout_strategy)
    if draw(st.booleans()):
        spec["eos_is_pad"] = True
    return spec


def _real_runs(spec: dict) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every maximal run of real tokens inside one document."""
    keep, docs = spec_layout(spec)
    runs = []
    for b in range(keep.shape[0]):
        t = 0
        S = keep.shape[1]
        while t < S:
            if not keep[b, t]:
                t += 1
                continue
            start = t
            while t < S and keep[b, t] and docs[b, t] == docs[b, start]:
                t += 1
            runs.append((b, start, t - start))
    return runs


_IMAGE_SIZES = ((2, 2), (2, 4), (4, 2), (4, 4), (2, 6))


def _boundaries(spec: dict, cp_size: int | None) -> list[int]:
    """Global positions where a shard starts (other than 0) for ``cp_size`` ranks."""
    if not cp_size or cp_size < 2:
        return []
    local = -(-int(spec["seq_len"]) // cp_size)
    return [r * local for r in range(1, cp_size)]


def _offset(draw, start: int, length: int, n: int, boundaries: list[int]) -> int:
    """Where an ``n``-token span goes inside a run: half the time across a shard boundary when one fits."""
    crossing = [o for o in range(length - n + 1) if any(start + o < b < start + o + n for b in boundaries)]
    if crossing and draw(st.booleans()):
        return draw(st.sampled_from(crossing))
    return draw(st.integers(min_value=0, max_value=length - n))


@st.composite
def inkling2_images(draw, spec: dict, cp_size: int | None = None) -> dict:
    """Add up to two inkling2 images (one span each) on real tokens; with ``cp_size``, spans are
    placed across a shard boundary half of the time."""
    boundaries = _boundaries(spec, cp_size)
    runs = _real_runs(spec)
    images: list[list[int]] = []
    taken: set[tuple[int, int]] = set()
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        h, w = draw(st.sampled_from(_IMAGE_SIZES))
        n = (h // PATCH_SIZE) * (w // PATCH_SIZE)
        fits = [r for r in runs if r[2] >= n]
        if not fits:
            break
        row, start, length = draw(st.sampled_from(fits))
        offset = _offset(draw, start, length, n, boundaries)
        slots = {(row, start + offset + i) for i in range(n)}
        if slots & taken:
            continue
        taken |= slots
        images.append([row, start + offset, h, w])
    if images:
        # The splice consumes image features in row-major order of the mask: order images to match.
        images.sort(key=lambda im: (im[0], im[1]))
        spec = dict(spec, images=images)
    return spec


@st.composite
def mistral_image(draw, spec: dict, cp_size: int | None = None) -> dict:
    """Maybe add one complete mistral_large4 image whose patches fill one or two spans of real tokens
    (across a shard boundary half of the time when ``cp_size`` is given)."""
    if not draw(st.booleans()):
        return spec
    runs = _real_runs(spec)
    h, w = draw(st.sampled_from(_IMAGE_SIZES))
    n = (h // PATCH_SIZE) * (w // PATCH_SIZE)
    fits = [r for r in runs if r[2] >= n]
    if not fits:
        return spec
    row, start, length = draw(st.sampled_from(fits))
    offset = _offset(draw, start, length, n, _boundaries(spec, cp_size))
    first = draw(st.integers(min_value=1, max_value=n))
    spans = [[row, start + offset, first]]
    if first < n:
        spans.append([row, start + offset + first, n - first])
    return dict(spec, images={"height": h, "width": w, "spans": spans})


# World meshes of training: CP inner and outer, data-parallel replicas beside it, a tensor-parallel dimension
# of size 1 (a CP module must not care), pipeline stages.
MESH_DIMS = (
    ("dp", "cp"),
    ("cp", "dp"),
    ("dp_shard", "cp", "tp"),
    ("dp_replicate", "dp_shard", "cp"),
    ("pp", "cp", "dp"),
    ("cp", "tp"),
)


@st.composite
def mesh_layouts(draw, cp_size: int, space: CaseSpace | None = None, min_groups: int = 1) -> dict:
    """A ``mesh_layout`` (``cp_harness.cases.meshes``) with a ``cp`` dimension of ``cp_size`` that fits the space's
    pool: two or three dimensions, CP inner or outer, mostly more than one CP group (a world larger than the CP
    group), over the first ranks of the pool, its last ones, or ranks spread over it; all groups run the case,
    or one of them. ``min_groups``: at least that many CP groups (nothing is drawn when they do not fit)."""
    pool = _resolved(space).pool_ranks
    room = max(pool // cp_size, 1)  # CP groups that fit
    if min_groups > room:
        return draw(st.nothing())
    dims = draw(st.sampled_from(MESH_DIMS))
    # Several groups two times in three (when they fit): what a CP group beside others gets wrong.
    counts = tuple(g for g in (1, 2, 2, 3, 4) if min_groups <= g <= room)
    groups = draw(st.sampled_from(counts)) if len(counts) > 1 else counts[0]
    others = [d for d in dims if d != "cp"]
    sizes = {d: 1 for d in others}
    free = [d for d in others if d != "tp"] or others  # tp stays 1
    if len(free) == 2 and groups % 2 == 0 and draw(st.booleans()):
        sizes[free[0]], sizes[free[1]] = 2, groups // 2
    else:
        sizes[free[-1]] = groups
    shape = [cp_size if d == "cp" else sizes[d] for d in dims]
    size = cp_size * groups
    where = draw(st.sampled_from(("first", "last", "spread")) if size < pool else st.just("first"))
    if where == "first":
        ranks = list(range(size))
    elif where == "last":
        ranks = list(range(pool - size, pool))
    else:
        ranks = sorted(draw(st.lists(st.integers(0, pool - 1), min_size=size, max_size=size, unique=True)))
    layout = {"dims": list(dims), "shape": shape, "ranks": ranks}
    if groups > 1 and draw(st.sampled_from((False, False, True))):
        layout["run"] = [draw(st.integers(0, groups - 1))]
    return layout


@st.composite
def with_mesh_layout(draw, case: dict, space: CaseSpace | None = None) -> dict:
    """``case`` on a drawn world mesh (``mesh_layouts``): it runs on ``world_mesh["cp"]`` of every CP group that
    runs it, instead of a one-dimensional mesh over ranks ``0..N-1`` (a case asking for no mesh gets one)."""
    case = {k: v for k, v in case.items() if k != "mesh"}
    case[meshes.KEY] = draw(mesh_layouts(int(case["world_size"]), space))
    return case


@st.composite
def row_images(draw, seq_len: int) -> list[list[int]]:
    """One row's images, ``[start, h, w]`` each (``h x w`` placeholder tokens from ``start``, ``h, w`` in 1..3): one
    or two, a text token between them and after the last (so the last image's last position has a text target),
    anywhere in the row, so that images cross the CP shard boundaries of most world sizes."""
    placed: list[list[int]] = []
    start = 0
    for _ in range(draw(st.integers(1, 2))):
        if start > seq_len - 2:
            break
        at = draw(st.integers(start, seq_len - 2))
        room = seq_len - 1 - at
        h = draw(st.integers(1, min(3, room)))
        w = draw(st.integers(1, min(3, room // h)))
        placed.append([at, h, w])
        start = at + h * w + 1
    return placed
