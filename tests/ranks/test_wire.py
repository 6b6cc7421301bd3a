"""``cp_harness.ranks.wire``: the pickle-free messages between the test process and the ranks, without a pool."""

from __future__ import annotations

import json
import socket
import struct
import threading

import numpy as np
import pytest

from cp_harness.ranks import wire


def _roundtrip(body, arrays):
    data = wire.encode(body, arrays)
    (length,) = struct.unpack(">Q", data[:8])
    header = json.loads(data[8:8 + length])
    assert wire.payload_size(header) == len(data) - 8 - length
    return wire.decode_payload(header, data[8 + length:])


@pytest.mark.parametrize("dtype", sorted(wire._ALLOWED_DTYPES))
def test_every_allowed_dtype_comes_back_bit_for_bit(dtype):
    values = (np.arange(24) % 7 - 3).astype(dtype).reshape(2, 3, 4)
    body, arrays = _roundtrip({"op": "result", "rank": 1}, {"x": values, "empty": np.zeros((0, 5), dtype=dtype)})
    assert body == {"op": "result", "rank": 1}
    assert arrays["x"].dtype == values.dtype and arrays["x"].shape == (2, 3, 4)
    assert arrays["x"].tobytes() == values.tobytes() and arrays["empty"].shape == (0, 5)


def test_a_transposed_array_arrives_in_its_logical_order():
    values = np.arange(12, dtype=np.float64).reshape(3, 4).T  # not C-contiguous
    _, arrays = _roundtrip(None, {"t": values})
    assert np.array_equal(arrays["t"], values) and arrays["t"].flags.c_contiguous


def test_a_dtype_that_is_not_plain_numbers_is_refused_when_sent():
    with pytest.raises(TypeError, match="array 'o' has dtype object"):
        wire.encode({}, {"o": np.array([object()])})


def test_a_header_that_names_another_dtype_or_too_few_bytes_is_refused():
    header = {"body": 1, "arrays": [["a", "object", [1]]]}
    with pytest.raises(wire.WireError, match="not allowed"):
        wire.decode_payload(header, b"\0" * 8)
    header = {"body": 1, "arrays": [["a", "float64", [4]]]}
    with pytest.raises(wire.WireError, match="truncated"):
        wire.decode_payload(header, b"\0" * 16)


def test_messages_cross_a_socket_and_a_silent_peer_times_out_saying_how_much_came():
    left, right = socket.socketpair()
    try:
        sent = wire.send(left, {"op": "run", "case_id": 3}, {"v": np.ones(3, dtype=np.int64)})
        assert sent > 0
        body, arrays = wire.recv(right, timeout=5)
        assert body["case_id"] == 3 and arrays["v"].tolist() == [1, 1, 1]
        left.sendall(wire.encode({"x": 1})[:5])  # part of the length prefix, then nothing
        with pytest.raises(wire.WireTimeout, match="5 of 8 bytes"):
            wire.recv(right, timeout=0.2)
    finally:
        left.close()
        right.close()


def test_a_closed_connection_and_a_corrupted_length_are_wire_errors():
    left, right = socket.socketpair()
    left.sendall(struct.pack(">Q", wire._MAX_HEADER_BYTES + 1))
    with pytest.raises(wire.WireError, match="corrupted"):
        wire.recv(right, timeout=5)
    left.close()
    with pytest.raises(wire.WireError, match="closed by peer"):
        wire.recv(right, timeout=5)
    right.close()


def test_a_large_message_arrives_whole_in_pieces():
    left, right = socket.socketpair()
    big = np.arange(3 << 18, dtype=np.float32)  # 3 MiB: more than one recv
    sender = threading.Thread(target=wire.send, args=(left, {"n": big.size}, {"big": big}))
    sender.start()
    try:
        body, arrays = wire.recv(right, timeout=30)
    finally:
        sender.join()
        left.close()
        right.close()
    assert body == {"n": big.size} and np.array_equal(arrays["big"], big)
