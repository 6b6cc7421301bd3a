"""The real-model rows' batch descriptions, drawn with Hypothesis (``cp_harness.checks.real_model`` and the
training-step rows draw their ``batch`` case keys here; ``real_model`` re-exports ``_batches``): a batch kind of the spec, a length of 2-24 tokens, rows,
and per kind its layout (padding, packed documents with single-token ones and one crossing every shard boundary,
a VLM's images placed anywhere in the row). Split from ``real_model`` at this seam (the module passed 600 lines).

A description is what ``model_specs.make_batch(spec, description)`` builds: ``{"kind", "seq_len", "batch_size",
"seed", ...}`` (``pad``, ``documents [[length, ...] per row]``, ``images [[[start, h, w], ...] per row]``).
"""

from __future__ import annotations

from hypothesis import strategies as st

from cp_harness.usage import spec_contract


@st.composite
def _row_images(draw, seq_len: int) -> list[list[int]]:
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


@st.composite
def _batches(draw, kinds: tuple[str, ...] = spec_contract.BATCH_KINDS, rows_for=lambda kind: (1, 2)) -> dict:
    kind = draw(st.sampled_from(kinds))
    seq_len = draw(st.integers(2, 24))
    counts = tuple(rows_for(kind))
    rows = draw(st.integers(1, 2)) if counts == (1, 2) else draw(st.sampled_from(counts))
    batch = {"kind": kind, "seq_len": seq_len, "batch_size": rows, "seed": draw(st.integers(0, 999))}
    if kind in ("right_padded", "left_padded"):
        batch["pad"] = draw(st.integers(1, seq_len - 2)) if seq_len >= 3 else 0
        if batch["pad"] == 0:
            if "plain" not in kinds:
                batch["seq_len"], batch["pad"] = 3, 1
            else:
                batch["kind"] = "plain"
                del batch["pad"]
    elif kind == "packed":
        documents = []
        for _ in range(rows):
            lengths: list[int] = []
            left = seq_len
            while left > 0 and len(lengths) < 5:
                length = draw(st.integers(1, left))  # single-token documents included
                lengths.append(length)
                left -= length
                if draw(st.booleans()):
                    break
            if max(lengths) < 2:  # every row needs a label
                lengths[0] += 1 if sum(lengths) < seq_len else 0
            documents.append(lengths)
        if all(max(d) < 2 for d in documents):
            documents[0] = [seq_len]  # one document crossing every shard boundary
        batch["documents"] = documents
    elif kind == "images":  # a VLM's rows: spec.make_batch(..., images=[[[start, h, w], ...] per row])
        batch["images"] = [draw(_row_images(seq_len)) for _ in range(rows)]
    return batch
