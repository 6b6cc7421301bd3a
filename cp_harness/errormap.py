"""Error-map pictures: where a failing token-aligned tensor is wrong.

One PNG per failing comparison: one pixel row block per batch row, one column
per global position; black is exact (or within budget), red shades grow with
the error (log scale), and vertical blue lines mark the shard boundaries, so
a boundary bug shows as red next to a blue line. Written with ``zlib`` alone
(no plotting dependency).
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
import zlib

import numpy as np

from cp_harness.cases import case_id

CELL = 6  # pixels per (row, position) cell


def _png(path: str, rgb: np.ndarray) -> None:
    """Write ``rgb`` ``[height, width, 3]`` uint8 as a PNG file."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))


def render(error_map: np.ndarray, local_len: int, cp_size: int) -> np.ndarray:
    """``[batch, sequence]`` errors (0 = fine) to an RGB picture with shard boundaries."""
    rows, positions = error_map.shape
    err = np.where(np.isfinite(error_map), error_map, np.nanmax(np.where(np.isfinite(error_map), error_map, 0)) * 10 + 1)
    intensity = np.zeros_like(err, dtype=np.float64)
    bad = err > 0
    if bad.any():
        logs = np.log10(err[bad])
        lo, hi = logs.min(), logs.max()
        intensity[bad] = 0.35 + 0.65 * ((logs - lo) / (hi - lo) if hi > lo else 1.0)
    img = np.zeros((rows * CELL, positions * CELL, 3), dtype=np.uint8)
    cells = np.kron(intensity, np.ones((CELL, CELL)))
    img[..., 0] = (cells * 255).astype(np.uint8)
    img[..., 1] = ((cells > 0) * 30).astype(np.uint8)
    for b in range(1, rows):  # thin grey separators between batch rows
        img[b * CELL, :, :] = 60
    if cp_size > 1 and local_len > 0:
        for r in range(1, cp_size):
            x = r * local_len * CELL
            if x < img.shape[1]:
                img[:, max(x - 1, 0):x + 1, :] = (40, 120, 255)
    return img


def write_error_maps(report, directory: str | None = None) -> list[str]:
    """Write a PNG for every failing comparison that has an error map; returns the paths."""
    directory = directory or os.environ.get("CP_HARNESS_ERROR_MAP_DIR") or os.path.join(tempfile.gettempdir(), "cp-harness-error-maps")
    paths = []
    for comp in report.failures():
        if comp.error_map is None or comp.grid is None:
            continue
        os.makedirs(directory, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{case_id(report.case)}-{comp.name}")[:120] + ".png"
        path = os.path.join(directory, name)
        _png(path, render(comp.error_map, comp.grid.local_len, comp.grid.cp_size))
        paths.append(path)
    return paths
