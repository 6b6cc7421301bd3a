"""Hypothesis strategies for CP cases.

Small composable pieces: layouts (packed THD rows, padded BSHD rows), images
placed on real tokens, and one ``*_cases`` strategy per check that yields a
complete case description (see ``cp_harness.cases.descriptions``). The tensors themselves
are not drawn here: each case carries a seed and is rebuilt deterministically
on every rank, so what Hypothesis shrinks is the structure (lengths, layout,
CP size), which is what CP bugs depend on.
"""

from __future__ import annotations

from hypothesis import strategies as st

from cp_harness.cases.descriptions import PATCH_SIZE, spec_layout

DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)
seeds = st.integers(min_value=0, max_value=2**31 - 1)
_active_world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES

# Floating dtypes (payloads, logits, models) and the integer/bool payloads of data-movement checks.
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
VALUE_DTYPES = ("int64", "bool")
ALL_DTYPES = FLOAT_DTYPES + VALUE_DTYPES + ("int32",)
_active_dtypes: tuple[str, ...] = FLOAT_DTYPES + VALUE_DTYPES


def configure_dtypes(names) -> None:
    """Restrict the dtypes strategies draw (``verify --dtypes``); default: every float dtype, int64 and bool."""
    global _active_dtypes
    unknown = sorted(set(names) - set(ALL_DTYPES))
    if unknown or not names:
        raise ValueError(f"dtypes {unknown or list(names)}: choose among {list(ALL_DTYPES)}")
    _active_dtypes = tuple(names)


def float_dtypes(allowed=FLOAT_DTYPES) -> st.SearchStrategy[str]:
    """A floating dtype among ``allowed`` and the configured ones (all four by default, equally likely)."""
    def pick():
        chosen = tuple(d for d in allowed if d in _active_dtypes)
        return st.sampled_from(chosen) if chosen else st.nothing()
    return st.deferred(pick)


def payload_dtypes() -> st.SearchStrategy[str]:
    """A data-movement payload: a float dtype two times in three, else an integer or bool payload."""
    def pick():
        floats = tuple(d for d in FLOAT_DTYPES if d in _active_dtypes)
        others = tuple(d for d in _active_dtypes if d not in FLOAT_DTYPES)
        if floats and others:
            return st.one_of(st.sampled_from(floats), st.sampled_from(floats), st.sampled_from(others))
        return st.sampled_from(floats or others)
    return st.deferred(pick)


def _payload(case: dict, name: str) -> dict:
    """Write a drawn payload dtype into a case: ``dtype`` for a float, else ``value_dtype`` (``dtype`` stays float64)."""
    if name in FLOAT_DTYPES:
        case["dtype"] = name
    else:
        case["dtype"], case["value_dtype"] = "float64", name
    return case


_size_draws: tuple[int, ...] = DEFAULT_WORLD_SIZES  # the sizes as drawn: a size listed twice is drawn twice as often

# The ci profile draws CP sizes above this half as often as the others: on 2 cores a case of 8 ranks costs
# 5-7 times one of 2 (every collective waits for 8 processes to be scheduled), and the 1,2,3,4 cases exercise
# the same shard boundaries; the nightly and dev profiles draw every size equally.
CI_FULL_WEIGHT_MAX_SIZE = 4


def configure_world_sizes(sizes, *, favour_small: bool = False) -> None:
    """Set the CP sizes that strategies draw from when none are passed (the plugin's ``--cp-world-sizes``).

    ``favour_small`` (the ci profile): sizes up to ``CI_FULL_WEIGHT_MAX_SIZE`` are drawn twice as often as
    larger ones (every size is still drawn; shrinking still goes towards the first).
    """
    global _active_world_sizes, _size_draws
    _active_world_sizes = tuple(sizes)
    if favour_small and any(n <= CI_FULL_WEIGHT_MAX_SIZE for n in sizes):
        _size_draws = tuple(n for n in sizes for _ in range(2 if n <= CI_FULL_WEIGHT_MAX_SIZE else 1))
    else:
        _size_draws = _active_world_sizes


_active_impls: tuple[str, ...] = ()


def configure_impls(names) -> None:
    """Set the implementations a run judges (the plugin's ``--cp-impl a,b``); with more than one, every case
    that goes through a sharder draws one of them into its ``"impl"`` key (shrinking towards the first)."""
    global _active_impls
    _active_impls = tuple(names)


def active_impls() -> tuple[str, ...]:
    """The implementations ``configure_impls`` set (to restore them after a run that changed them)."""
    return _active_impls


@st.composite
def with_impl(draw, case: dict) -> dict:
    """``case`` with an ``"impl"`` drawn from the configured implementations (unchanged when one is judged)."""
    if len(_active_impls) > 1:
        case = {**case, "impl": draw(st.sampled_from(_active_impls))}
    return case


def world_sizes(allowed=None) -> st.SearchStrategy[int]:
    """A CP size from ``allowed`` (default: the configured sizes, read when drawn)."""
    if allowed is not None:
        return st.sampled_from(tuple(allowed))
    return st.deferred(lambda: st.sampled_from(_size_draws))


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
        left = {"none": 0, "left": room, "right": 0}.get(style)
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
    images, taken = [], set()
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


# ------------------------------------------------------------------------ per-check cases
@st.composite
def gather_cases(draw, allowed_sizes=None, check: str | None = None) -> dict:
    """``gather_sequence`` / ``gather_tokens`` cases, every float dtype and integer/bool payloads, mesh or ``None``."""
    n = draw(world_sizes(allowed_sizes))
    check = check or draw(st.sampled_from(("gather_sequence", "gather_tokens")))
    payload = draw(payload_dtypes())
    local = draw(st.integers(min_value=1, max_value=5))
    rest = draw(st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=2))
    shape = [draw(st.integers(min_value=1, max_value=3)), local, *rest] if check == "gather_sequence" else [local, *rest]
    case = _payload({"check": check, "world_size": n, "seed": draw(seeds)}, payload)
    case["shape"] = shape
    case["differentiable"] = draw(st.booleans()) if payload in FLOAT_DTYPES else False
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return case


@st.composite
def history_cases(draw, allowed_sizes=None) -> dict:
    """``convolution_history`` cases (every float dtype, integer and bool payloads), widths whose history is
    often longer than a shard."""
    n = draw(world_sizes(allowed_sizes))
    local = draw(st.integers(min_value=1, max_value=4))
    width = draw(st.integers(min_value=1, max_value=3 * local + 2))
    case = _payload({"check": "convolution_history", "world_size": n, "seed": draw(seeds)}, draw(payload_dtypes()))
    case.update({
            "shape": [draw(st.integers(min_value=1, max_value=2)), local, draw(st.integers(min_value=1, max_value=3))],
            "width": width})
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return case


@st.composite
def loss_cases(draw, allowed_sizes=None) -> dict:
    n = draw(world_sizes(allowed_sizes))
    return {"check": "shifted_cp_loss", "world_size": n, "seed": draw(seeds), "model": "mistral_large4",
            "dtype": draw(float_dtypes()), "vocab": draw(st.integers(min_value=2, max_value=13)),
            "batch": draw(with_extras(layouts(min_len=2, max_len=24)))}


@st.composite
def layout_cases(draw, allowed_sizes=None) -> dict:
    """Sharded-layout cases for either model, ``num_chunks`` > 1 and ``shard_primary`` both ways."""
    n = draw(world_sizes(allowed_sizes))
    model = draw(st.sampled_from(("inkling2", "mistral_large4")))
    if model == "mistral_large4" and draw(st.booleans()):
        chunks = draw(st.integers(min_value=1, max_value=3))
        spec = draw(packed_layout(max_len=30, rows=chunks))
    else:
        spec = draw(layouts(max_len=30, max_rows=4))
        rows = len(spec["docs"] if spec["format"] == "thd" else spec["rows"])
        chunks = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
        if model == "mistral_large4" and spec["format"] == "thd":
            chunks = rows  # one packed row per micro-batch
    spec = draw(with_extras(st.just(spec)))
    spec = draw(inkling2_images(spec, n)) if model == "inkling2" else draw(mistral_image(spec, n))
    case = {"check": f"{model}_layout", "world_size": n, "seed": draw(seeds), "model": model, "batch": spec,
            "num_chunks": chunks}
    if model == "mistral_large4":
        case["shard_primary"] = draw(st.booleans())
        if spec["format"] == "thd" and draw(st.booleans()):
            case["direct_packed"] = True
    return draw(with_impl(case))


@st.composite
def model_cases(draw, allowed_sizes=None, dtypes=("float64",), max_len: int = 24) -> dict:
    """End-to-end miniature-model cases (both models, packed and padded rows, images across boundaries)."""
    n = draw(world_sizes(allowed_sizes))
    model = draw(st.sampled_from(("inkling2", "mistral_large4")))
    if model == "mistral_large4" and draw(st.booleans()):
        chunks = draw(st.integers(min_value=1, max_value=2))
        spec = draw(packed_layout(min_len=3, max_len=max_len, rows=chunks))
    else:
        spec = draw(layouts(min_len=3, max_len=max_len, max_rows=2))
        rows = len(spec["docs"] if spec["format"] == "thd" else spec["rows"])
        chunks = rows if (model == "mistral_large4" and spec["format"] == "thd") else draw(
            st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
    spec = draw(with_extras(st.just(spec)))
    spec = draw(inkling2_images(spec, n)) if model == "inkling2" else draw(mistral_image(spec, n))
    case = {"check": "model", "world_size": n, "seed": draw(seeds), "model": model,
            "dtype": draw(float_dtypes(tuple(dtypes))), "batch": spec, "num_chunks": chunks}
    if model == "mistral_large4":
        case["shard_primary"] = draw(st.booleans())
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return draw(with_impl(case))


@st.composite
def sharder_cases(draw, allowed_sizes=None) -> dict:
    """``shard_token_tensor`` / ``gather_token_tensor`` round trips (sequence not a multiple of N included)."""
    n = draw(world_sizes(allowed_sizes))
    case = {"check": "sharder_roundtrip", "world_size": n, "seed": draw(seeds),
            **_payload({}, draw(payload_dtypes())),
            "shape": [draw(st.integers(min_value=1, max_value=3)), draw(st.integers(min_value=1, max_value=19)),
                      draw(st.integers(min_value=1, max_value=3))]}
    if n == 1 and draw(st.booleans()):
        case["mesh"] = "none"
    return draw(with_impl(case))


@st.composite
def position_cases(draw, allowed_sizes=None) -> dict:
    """``validate_document_positions`` cases: a layout's positions, valid or corrupted in one place."""
    kind = draw(st.sampled_from(("none", "offset_start", "negative", "jump", "resume")))
    spec = draw(layouts(min_len=1, max_len=24, max_rows=3))
    case = {"check": "validate_document_positions", "world_size": draw(world_sizes(allowed_sizes)),
            "seed": draw(seeds), "model": "inkling2", "batch": spec}
    if kind != "none":
        case["corruption"] = {"kind": kind, "row": draw(st.integers(min_value=0, max_value=3)),
                              "nth": draw(st.integers(min_value=0, max_value=7))}
    return case
