"""jaxdp/cluster/wire.py, the one framing of the launcher-side sockets: what goes in comes out, and whatever
is not one of our messages (truncated, oversize, not an object, wrong field types, nothing at all
within the timeout) is a ProtocolError, on the blocking and the non-blocking side alike."""

import json
import socket
import struct

import numpy as np
import pytest

from jaxdp.cluster import wire


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def raw(header_bytes: bytes, payload: bytes = b"", payload_len: int | None = None) -> bytes:
    """A message written out by hand: >I header length, >Q payload length, header, payload."""
    size = len(payload) if payload_len is None else payload_len
    return struct.pack(">IQ", len(header_bytes), size) + header_bytes + payload


def test_round_trip_with_a_payload_blocking_and_fed_byte_by_byte(pair):
    a, b = pair
    arrays = [np.arange(5, dtype=np.float32), np.array([7], np.int64)]
    wire.send(a, {"op": "partial", "step": 3, "shards": [1, 2]}, arrays)
    wire.send(a, {"op": "bye"})
    header, payload = wire.receive(b, timeout=5, max_payload=1 << 20)
    assert header == {"op": "partial", "step": 3, "shards": [1, 2]}
    assert bytes(payload) == arrays[0].tobytes() + arrays[1].tobytes()
    assert wire.receive(b, timeout=5) == ({"op": "bye"}, bytearray())
    # The same bytes through a Reader, one byte at a time: the messages come out whole, in order.
    data = raw(b'{"op":"partial","step":3}', b"\x01\x02\x03") + raw(b'{"op":"bye"}')
    reader, out = wire.Reader(max_payload=16), []
    for i in range(len(data)):
        out += reader.feed(data[i:i + 1])
        assert reader.waiting_s() >= 0
    assert out == [({"op": "partial", "step": 3}, bytearray(b"\x01\x02\x03")), ({"op": "bye"}, bytearray())]
    assert reader.waiting_s() == 0  # nothing under way


def test_a_truncated_message_is_a_protocol_error(pair):
    a, b = pair
    a.sendall(raw(b'{"op":"partial"}', b"abcdef")[:-2])  # two payload bytes short
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(wire.ProtocolError, match="closed in the middle of a message"):
        wire.receive(b, timeout=5, max_payload=100)
    reader = wire.Reader(max_payload=100)
    assert reader.feed(raw(b'{"op":"partial"}', b"abcdef")[:-2]) == []
    assert reader.waiting_s() > 0  # the caller's timeout runs on it


def test_oversize_header_or_payload_is_refused_before_it_is_read(pair):
    a, b = pair
    a.sendall(struct.pack(">IQ", wire.MAX_HEADER + 1, 0))
    with pytest.raises(wire.ProtocolError, match="a header of 65537 bytes"):
        wire.receive(b, timeout=5)
    with pytest.raises(wire.ProtocolError, match="a payload of 11 bytes \\(at most 10\\)"):
        wire.Reader(max_payload=10).feed(raw(b'{"op":"x"}', payload_len=11))
    with pytest.raises(wire.ProtocolError, match="a payload of 1 bytes \\(at most 0\\)"):
        wire.Reader().feed(raw(b'{"op":"x"}', b"!"))  # the handshake's and rendezvous's messages carry none
    with pytest.raises(wire.ProtocolError, match="a header of 0 bytes"):
        wire.Reader().feed(raw(b""))
    with pytest.raises(ValueError):
        wire.encode({"op": "x" * wire.MAX_HEADER})  # never sent


@pytest.mark.parametrize("header, why", [
    (b"[1]", "a JSON list, not an object"),
    (b'"op"', "a JSON str, not an object"),
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_header_that_is_not_a_json_object_is_a_protocol_error(pair, header, why):
    a, b = pair
    a.sendall(raw(header))
    with pytest.raises(wire.ProtocolError, match=why):
        wire.receive(b, timeout=5)
    with pytest.raises(wire.ProtocolError, match=why):
        wire.Reader().feed(raw(header))


def test_fields_of_the_wrong_type_are_a_protocol_error():
    good = {"op": "partial", "step": 3, "shard": 1, "shards": [0, 1], "ratio": 0.5}
    assert wire.check(good, op=str, step=int, shards=wire.INTS, ratio=(int, float)) is good
    for header, field, got in [({**good, "step": "abc"}, "step", "str"), ({**good, "step": True}, "step", "bool"),
                               ({**good, "step": 1.0}, "step", "float"), ({**good, "shards": [0, "1"]}, "shards", "list"),
                               ({**good, "shards": 5}, "shards", "int"), ({"op": "partial"}, "step", "missing")]:
        with pytest.raises(wire.ProtocolError, match=f"field '{field}' of a 'partial' message is {got}, not"):
            wire.check(header, step=int, shards=wire.INTS)


def test_a_peer_that_sends_nothing_within_the_timeout_is_a_protocol_error(pair):
    a, b = pair
    with pytest.raises(wire.ProtocolError, match="no complete message within the read timeout"):
        wire.receive(b, timeout=0.2)
    a.sendall(raw(b'{"op":"partial"}', b"ab")[:5])  # a message begun, never finished
    with pytest.raises(wire.ProtocolError, match="no complete message within the read timeout"):
        wire.receive(b, timeout=0.2)
    # Non-blocking: a read with nothing there returns nothing (it never waits); closed is an error.
    b.setblocking(False)
    reader = wire.Reader()
    assert reader.read(b) == []
    a.close()
    with pytest.raises(wire.ProtocolError, match="closed"):
        reader.read(b)


def test_the_length_prefix_is_big_endian_and_the_header_plain_json(pair):
    a, b = pair
    wire.send(a, {"ok": True}, [b"xy"])
    data = b.recv(100)
    assert struct.unpack(">IQ", data[:12]) == (len(data) - 14, 2) and json.loads(data[12:-2]) == {"ok": True}
