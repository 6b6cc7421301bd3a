"""Hypothesis pieces shared by the oracle tests (not a test module)."""

from hypothesis import strategies as st


@st.composite
def packed_lengths(draw, max_sequence: int) -> tuple[int, list[int], list[int]]:
    """``(sequence, real lengths, padded lengths)`` of one THD row: up to 3 documents, any of them empty."""
    sequence = draw(st.integers(1, max_sequence))
    lens, padded, budget = [], [], sequence
    for _ in range(draw(st.integers(0, 3))):
        p = draw(st.integers(0, budget))
        r = draw(st.integers(0, p))
        budget -= p
        lens.append(r)
        padded.append(p)
    return sequence, lens, padded
