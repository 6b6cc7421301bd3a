"""Error-map pictures: where a failing token-aligned tensor is wrong.

One PNG per failing comparison of a token-aligned tensor (``[batch,
sequence, ...]`` in global order): one band of pixels per batch row, one
column per global position (the largest error over the trailing dims). Black
is right (exact, or within budget); red grows with the error on a log scale
(yellow: not finite); vertical blue lines are the shard boundaries, with the
owning rank written above each shard. A boundary bug is red next to a blue
line; a bug of one rank is red across one shard; a loss scaled wrongly is red
everywhere. The title names the tensor, the case and the worst element, and the
legend gives the error range.

Pictures are written with ``zlib`` alone (no plotting dependency), with a
small built-in bitmap font. They go to the folder the caller names (``--error-maps``, ``$CP_HARNESS_ERROR_MAP_DIR``; else
``<temp>/cp-harness-error-maps``); the failure message prints each path.
"""

from __future__ import annotations

import math
import os
import re
import struct
import tempfile
import zlib
from typing import Any

import numpy as np

from cp_harness.cases.descriptions import case_id

# Target size of the grid in pixels; cells are scaled (and very long sequences max-pooled) to fit.
TARGET_WIDTH = 720
MAX_COLUMNS = 1440
MAX_CELL = 28
ROW_HEIGHT = (14, 40)  # pixels per batch row: min, max
FONT_SCALE = 2

BACKGROUND = (24, 24, 28)
TEXT = (230, 230, 230)
DIM_TEXT = (150, 150, 160)
BOUNDARY = (60, 140, 255)
ROW_SEPARATOR = (70, 70, 70)
NONFINITE = (255, 230, 0)

# 3x5 bitmap font: each glyph is five rows of three bits.
_GLYPHS = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001010010",
    "8": "111101111101111",
    "9": "111101111001111",
    "A": "010101111101101",
    "B": "110101110101110",
    "C": "011100100100011",
    "D": "110101101101110",
    "E": "111100110100111",
    "F": "111100110100100",
    "G": "011100101101011",
    "H": "101101111101101",
    "I": "111010010010111",
    "J": "001001001101010",
    "K": "101101110101101",
    "L": "100100100100111",
    "M": "101111111101101",
    "N": "110101101101101",
    "O": "010101101101010",
    "P": "110101110100100",
    "Q": "010101101110011",
    "R": "110101110101101",
    "S": "011100010001110",
    "T": "111010010010010",
    "U": "101101101101111",
    "V": "101101101101010",
    "W": "101101111111101",
    "X": "101101010101101",
    "Y": "101101010010010",
    "Z": "111001010100111",
    " ": "000000000000000",
    ".": "000000000000010",
    "-": "000000111000000",
    "+": "000010111010000",
    "/": "001001010100100",
    ":": "000010000010000",
    "=": "000111000111000",
    "@": "010101111100011",
    "_": "000000000000111",
    "(": "010100100100010",
    ")": "010001001001010",
    ",": "000000000010100",
    "[": "110100100100110",
    "]": "011001001001011",
    "<": "001010100010001",
    ">": "100010001010100",
    "%": "101001010100101",
    "#": "101111101111101",
    "?": "111001010000010",
    "!": "010010010000010",
    "'": "010010000000000",
    '"': "101101000000000",
    "*": "000101010101000",
    "|": "010010010010010",
}


def _text_width(text: str, scale: int = FONT_SCALE) -> int:
    return len(text) * 4 * scale


def _draw_text(img: np.ndarray, x: int, y: int, text: str, color=TEXT, scale: int = FONT_SCALE) -> None:
    """Draw ``text`` (upper-cased; unknown characters as ``?``) with its top-left corner at ``(x, y)``."""
    h, w, _ = img.shape
    for i, ch in enumerate(text.upper()):
        bits = _GLYPHS.get(ch, _GLYPHS["?"])
        gx = x + i * 4 * scale
        for r in range(5):
            for c in range(3):
                if bits[r * 3 + c] == "1":
                    y0, x0 = y + r * scale, gx + c * scale
                    if 0 <= y0 and y0 + scale <= h and 0 <= x0 and x0 + scale <= w:
                        img[y0 : y0 + scale, x0 : x0 + scale] = color


def _png(path: str, rgb: np.ndarray) -> None:
    """Write ``rgb`` ``[height, width, 3]`` uint8 as a PNG file (8-bit truecolour, no filtering)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))
    os.replace(tmp, path)


def _pool(values: np.ndarray, axis: int, factor: int) -> np.ndarray:
    """Max-pool ``values`` along ``axis`` by ``factor`` (NaN-free input; the tail group may be shorter)."""
    if factor <= 1:
        return values
    n = values.shape[axis]
    groups = math.ceil(n / factor)
    pad = groups * factor - n
    if pad:
        widths = [(0, 0)] * values.ndim
        widths[axis] = (0, pad)
        values = np.pad(values, widths, constant_values=0.0)
    shape = list(values.shape)
    shape[axis : axis + 1] = [groups, factor]
    return values.reshape(shape).max(axis=axis + 1)


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "INF"
    return f"{x:.3g}"


def render(
    error_map: np.ndarray,
    local_len: int,
    cp_size: int,
    *,
    title: list[str] | None = None,
    unit: str = "error",
    segments: list[tuple[int, int, int]] | None = None,
) -> np.ndarray:
    """``[batch, sequence]`` errors (0 = right, ``inf``/NaN = not finite) to an RGB picture.

    ``local_len``/``cp_size``: the shard grid (boundaries at multiples of
    ``local_len``), or ``segments``: ``(start, end, rank)`` runs of global
    positions each rank owns (any index map, e.g. load-balanced chunks);
    ``title``: lines written above the map; ``unit``: what the numbers in the
    legend measure.
    """
    err = np.asarray(error_map, dtype=np.float64)
    if err.ndim != 2:
        err = err.reshape(err.shape[0], -1) if err.ndim > 2 else err.reshape(1, -1)
    nonfinite = ~np.isfinite(err)
    err = np.where(nonfinite, 0.0, np.maximum(err, 0.0))
    rows, positions = err.shape

    # Pool very long sequences / many rows so that the picture stays readable.
    col_factor = max(1, math.ceil(positions / MAX_COLUMNS))
    row_factor = max(1, math.ceil(rows / 128))
    err_p = _pool(_pool(err, 1, col_factor), 0, row_factor)
    bad_p = _pool(_pool(nonfinite.astype(np.float64), 1, col_factor), 0, row_factor) > 0
    prow, pcol = err_p.shape
    cell_w = int(min(MAX_CELL, max(1, TARGET_WIDTH // max(pcol, 1))))
    cell_h = int(min(ROW_HEIGHT[1], max(ROW_HEIGHT[0], cell_w)))
    grid_w, grid_h = pcol * cell_w, prow * cell_h

    finite_bad = err_p[err_p > 0]
    lo = float(finite_bad.min()) if finite_bad.size else 0.0
    hi = float(finite_bad.max()) if finite_bad.size else 0.0
    intensity = np.zeros_like(err_p)
    if finite_bad.size:
        logs = np.log10(err_p[err_p > 0])
        span = math.log10(hi) - math.log10(lo) if hi > lo else 0.0
        intensity[err_p > 0] = 0.35 + 0.65 * ((logs - math.log10(lo)) / span if span > 0 else 1.0)

    title = [t for t in (title or []) if t]
    line_h = 7 * FONT_SCALE
    label_w = _text_width(f"B{max(rows - 1, 0)}") + 6
    top = 8 + len(title) * line_h + 4 + line_h  # title lines, then the rank labels
    legend_h = 2 * line_h + 16
    legend_text = [
        f"{unit}: {_fmt(lo)} .. {_fmt(hi)}" + ("   yellow: not finite" if nonfinite.any() else ""),
        "blue: shard boundary   black: right",
    ]
    ramp_w = 120
    width = max(
        label_w + grid_w + 8,
        8 + max((_text_width(t) for t in title + legend_text[1:]), default=0) + 8,
        16 + ramp_w + _text_width(legend_text[0]) + 8,
    )
    height = top + grid_h + legend_h
    img = np.zeros((height, width, 3), dtype=np.uint8)
    img[:] = BACKGROUND

    for i, line in enumerate(title):
        _draw_text(img, 8, 8 + i * line_h, line, TEXT if i == 0 else DIM_TEXT)

    # The grid: red for errors, yellow for non-finite values.
    if cell_w < 3 and pcol > 1:
        # One-pixel columns are hard to see: widen every error by a column on each side (display only).
        intensity = np.maximum(
            intensity,
            np.maximum(np.pad(intensity, ((0, 0), (1, 0)))[:, :-1], np.pad(intensity, ((0, 0), (0, 1)))[:, 1:]),
        )
        bad_p = bad_p | np.pad(bad_p, ((0, 0), (1, 0)))[:, :-1] | np.pad(bad_p, ((0, 0), (0, 1)))[:, 1:]
    cells = np.zeros((prow, pcol, 3), dtype=np.float64)
    cells[..., 0] = intensity * 255
    cells[..., 1] = (intensity > 0) * 30
    cells[bad_p] = NONFINITE
    block = np.repeat(np.repeat(cells.astype(np.uint8), cell_h, axis=0), cell_w, axis=1)
    gx, gy = label_w, top
    img[gy : gy + grid_h, gx : gx + grid_w] = block
    if cell_h >= 6:
        for b in range(1, prow):
            img[gy + b * cell_h, gx : gx + grid_w] = ROW_SEPARATOR
    for b in range(prow):
        label = f"B{b * row_factor}"
        _draw_text(img, 2, gy + b * cell_h + max(0, (cell_h - 5 * FONT_SCALE) // 2), label, DIM_TEXT)

    # Shard boundaries and rank labels (in pooled columns).
    if segments is None:
        segments = [(r * local_len, (r + 1) * local_len, r) for r in range(max(cp_size, 1))] if local_len > 0 else []
    px_per_position = cell_w / col_factor
    for start, end, rank in segments:
        x0 = gx + int(round(start * px_per_position))
        if x0 >= gx + grid_w:  # the tensor ends before this shard (e.g. a local tensor, or no padding shown)
            break
        if start > 0:
            xs = slice(max(x0 - 1, 0), x0 + 1)
            img[gy - 4 : gy, xs] = BOUNDARY
            img[gy + grid_h : gy + grid_h + 4, xs] = BOUNDARY
            inside = img[gy : gy + grid_h, xs]
            free = inside.max(axis=-1) <= max(ROW_SEPARATOR)  # never paint over an error
            inside[free] = BOUNDARY
        label = f"R{rank}"
        room = min(int(round((end - start) * px_per_position)), gx + grid_w - x0)  # the visible part of this shard
        if room >= _text_width(label) + 2:
            _draw_text(img, x0 + (room - _text_width(label)) // 2, gy - line_h, label, BOUNDARY)

    # Legend: the colour ramp and what it means.
    ly = gy + grid_h + 8
    ramp = np.linspace(0.35, 1.0, ramp_w)
    img[ly : ly + line_h - 4, 8 : 8 + ramp_w, 0] = (ramp * 255).astype(np.uint8)[None, :]
    img[ly : ly + line_h - 4, 8 : 8 + ramp_w, 1] = 30
    img[ly : ly + line_h - 4, 8 : 8 + ramp_w, 2] = 0
    _draw_text(img, 16 + ramp_w, ly, legend_text[0], TEXT)
    _draw_text(img, 8, ly + line_h + 2, legend_text[1], DIM_TEXT)
    return img


def _titles(report, comp) -> list[str]:
    case = report.case
    grid = comp.grid
    x: Any = getattr(comp, "excess", None)  # an ExcessVerdict or None: read only when it failed
    failed = x is not None and x.failed
    lines = [
        f"{comp.name}",
        f"{case_id(case)}  N={case.get('world_size')}  L={grid.local_len if grid else '?'}"
        + (
            f"  {x.mismatched} of {comp.compared} elements above the excess allowance"
            if failed
            else f"  {comp.mismatched} of {comp.compared} elements wrong"
        ),
    ]
    if failed:
        lines.append(
            f"CP error {x.error:.3g} ULP > {x.limit:g} x one-rank error {x.baseline:.3g} + {x.floor:g} (normwise)"
        )
    if comp.location:
        loc = comp.location
        distance = loc.get("distance_to_shard_boundary")
        lines.append(
            f"worst: row {loc['row']} position {loc['position']} rank {loc['owning_rank']}"
            + ("  divisibility padding" if loc.get("divisibility_padding") else "")
            + (f"  {distance} from a boundary" if distance is not None else "")
        )
    return lines


def error_map_dir(directory: str | None = None) -> str:
    """Where error maps go: ``directory``, else ``<temp>/cp-harness-error-maps`` (the command line and the plugin
    pass ``--error-maps`` / ``--cp-error-maps``, or ``$CP_HARNESS_ERROR_MAP_DIR``, read at their boundary)."""
    return directory or os.path.join(tempfile.gettempdir(), "cp-harness-error-maps")


def write_error_maps(report, directory: str | None = None) -> list[str]:
    """Write a PNG for every failing comparison that has an error map; returns the absolute paths."""
    directory = os.path.abspath(error_map_dir(directory))
    paths = []
    for comp in report.failures():
        if comp.error_map is None or comp.grid is None:
            continue
        os.makedirs(directory, exist_ok=True)
        group = "-" + comp.group.split(" (")[0] if comp.group else ""  # "CP group 1 (...)": one map per group
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{case_id(report.case)}{group}-{comp.name}")[:120] + ".png"
        path = os.path.join(directory, name)
        unit = comp.error_map_unit or ("error (ULP)" if comp.arithmetic else "absolute difference")
        segments = comp.grid.segments(comp.error_map.shape[1]) if comp.grid.owners is not None else None
        _png(
            path,
            render(
                comp.error_map,
                comp.grid.local_len,
                comp.grid.cp_size,
                title=_titles(report, comp),
                unit=unit,
                segments=segments,
            ),
        )
        paths.append(path)
    return paths
