"""Helpers the project's own tests share (tests import these, never each other's private helpers)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(path: Path) -> tuple[int, int]:
    """Parse a PNG completely (signature, chunk CRCs, IHDR, IDAT size); returns ``(width, height)``."""
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} does not start with the PNG signature"
    pos, chunks, idat = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, f"{path}: bad CRC in chunk {tag!r}"
        chunks.append(tag)
        if tag == b"IDAT":
            idat += body
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, chunks
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    assert (depth, colour) == (8, 2), "expected 8-bit truecolour"
    assert len(zlib.decompress(idat)) == height * (1 + 3 * width)
    assert width >= 100 and height >= 50, f"error map {width}x{height} is too small to read"
    return width, height


def error_maps(stdout: str) -> list[Path]:
    return [Path(line.split("error map:", 1)[1].strip()) for line in stdout.splitlines() if "error map:" in line]
