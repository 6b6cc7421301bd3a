"""Pickle-free messages between the test process and the ranks.

A message is a JSON header followed by the raw bytes of its arrays:

    [8-byte big-endian header length][header JSON][array bytes ...]

The header is ``{"body": <JSON value>, "arrays": [[name, dtype, shape], ...]}``
and the arrays follow in that order, C-contiguous, native little-endian.
Nothing on the receiving side can execute code: JSON and raw numbers only.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

import numpy as np

_HEADER = struct.Struct(">Q")
# Header lengths beyond this are a corrupted stream, not a message.
_MAX_HEADER_BYTES = 64 * 1024 * 1024
_ALLOWED_DTYPES = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


class WireError(RuntimeError):
    """The peer closed the connection or sent something that is not a message."""


class WireTimeout(WireError):
    """No complete message arrived before the deadline."""


def encode(body: Any, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """Serialise a JSON-able ``body`` and named numpy ``arrays`` into one message."""
    arrays = arrays or {}
    specs, blobs = [], []
    for name, value in arrays.items():
        value = np.asarray(value)
        if not value.flags.c_contiguous:
            value = value.copy(order="C")
        if value.dtype.name not in _ALLOWED_DTYPES:
            raise TypeError(f"array {name!r} has dtype {value.dtype}; send one of {sorted(_ALLOWED_DTYPES)}")
        specs.append([name, value.dtype.name, list(value.shape)])
        blobs.append(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
    header = json.dumps({"body": body, "arrays": specs}, separators=(",", ":")).encode()
    return b"".join([_HEADER.pack(len(header)), header, *blobs])


def decode_payload(header: dict, payload: bytes) -> tuple[Any, dict[str, np.ndarray]]:
    """Rebuild ``(body, arrays)`` from a parsed header and the bytes that followed it."""
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for name, dtype, shape in header["arrays"]:
        if dtype not in _ALLOWED_DTYPES:
            raise WireError(f"array {name!r} declares dtype {dtype!r}, which is not allowed")
        dt = np.dtype(dtype).newbyteorder("<")
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dt.itemsize
        if offset + nbytes > len(payload):
            raise WireError(f"array {name!r} is truncated ({len(payload) - offset} of {nbytes} bytes)")
        arrays[name] = np.frombuffer(payload, dtype=dt, count=count, offset=offset).reshape(shape).copy()
        offset += nbytes
    return header["body"], arrays


def payload_size(header: dict) -> int:
    """Number of array bytes that follow ``header`` on the stream."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for _, dtype, shape in header["arrays"])


def send(sock: socket.socket, body: Any, arrays: dict[str, np.ndarray] | None = None) -> int:
    """Send one message; returns the number of bytes written."""
    data = encode(body, arrays)
    sock.sendall(data)
    return len(data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WireTimeout(f"timed out with {got} of {n} bytes received")
            sock.settimeout(remaining)
        else:
            sock.settimeout(None)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except TimeoutError as exc:
            raise WireTimeout(f"timed out with {got} of {n} bytes received") from exc
        except OSError as exc:
            raise WireError(f"connection failed: {exc}") from exc
        if not chunk:
            raise WireError(f"connection closed by peer after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, timeout: float | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """Receive one message; ``timeout`` in seconds (``None`` waits for ever, used only by idle ranks)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if length > _MAX_HEADER_BYTES:
        raise WireError(f"header of {length} bytes: the stream is corrupted")
    header = json.loads(_recv_exact(sock, length, deadline))
    payload = _recv_exact(sock, payload_size(header), deadline)
    return decode_payload(header, payload)
