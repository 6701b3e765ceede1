"""The frame codec: round trips, and every way a stream can be broken."""

from __future__ import annotations

import asyncio
import io
import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clef_protocol import messages
from clef_protocol.errors import ProtocolError
from clef_protocol.frames import (
    FrameBuffer,
    FrameDecodeError,
    FrameTooLarge,
    FrameTruncated,
    encode_frame,
    read_frame,
    read_frame_blocking,
    write_frame_blocking,
)


def _read_async(data: bytes, max_size: int | None = None) -> dict | None:
    async def go() -> dict | None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        if max_size is None:
            return await read_frame(reader)
        return await read_frame(reader, max_size)

    return asyncio.run(go())


def _read_buffered(data: bytes, max_size: int) -> dict | None:
    """FrameBuffer fed one byte at a time, the worst split a pipe can deliver."""
    buffer = FrameBuffer(max_size)
    for i in range(len(data)):
        buffer.feed(data[i:i + 1])
        message = buffer.next_frame()
        if message is not None:
            return message
    buffer.end()
    return None


def _read_both(data: bytes, max_size: int = 1 << 20) -> list[dict | None]:
    """The blocking and the asyncio reader (and the callback buffer, which must agree)."""
    both = [read_frame_blocking(io.BytesIO(data), max_size), _read_async(data, max_size)]
    assert _read_buffered(data, max_size) == both[0]
    return both


@given(st.lists(st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1),
                                max_size=3), max_size=6),
       st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_frame_buffer_reassembles_frames_from_any_split(maps: list[dict], cuts: list[int]) -> None:
    messages_in = [{**m, "kind": "x"} for m in maps]
    stream = b"".join(encode_frame(m) for m in messages_in)
    buffer, out, at = FrameBuffer(), [], 0
    for cut in cuts * (len(stream) // sum(cuts) + 1):
        buffer.feed(stream[at:at + cut])
        at += cut
        while (message := buffer.next_frame()) is not None:
            out.append(message)
    buffer.end()
    assert out == messages_in


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text() | st.binary(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=8), values, max_size=5))
def test_round_trip_any_map(payload: dict) -> None:
    message = {**payload, "kind": "x"}
    assert _read_both(encode_frame(message)) == [message, message]


def test_header_is_big_endian_length() -> None:
    frame = encode_frame(messages.shutdown())
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4


def test_request_body_bytes_survive_unchanged() -> None:
    body = b'{"model":"m","state":"\xc3\xa9"}'
    out = io.BytesIO()
    write_frame_blocking(out, messages.request(7, body, "req-7", TRACE))
    got = read_frame_blocking(io.BytesIO(out.getvalue()))
    assert got == {"kind": "request", "id": 7, "body": body, "request_id": "req-7",
                   "trace_id": TRACE}
    assert got is not None and messages.from_front(got) == messages.Request(7, body, "req-7",
                                                                            TRACE)


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_every_frame_decodes_to_its_typed_value() -> None:
    """Both ways: what the constructors build, the decoders give back as one value each."""
    assert messages.from_front(messages.ping(3)) == messages.Ping(3)
    assert messages.from_front(messages.shutdown()) == messages.Shutdown()
    assert messages.from_worker(messages.pong(3)) == messages.Pong(3)
    assert messages.from_worker(messages.fatal("no GPU")) == messages.Fatal("no GPU")
    reply = messages.from_worker(messages.response(5, b"{}", 2.0, batch_size=3,
                                                   stages={"forward_ms": 1.5}))
    assert reply == messages.WorkerReply(200, b"{}", None, 2.0, batch_size=3,
                                         stages={"forward_ms": 1.5}, id=5)
    assert messages.from_worker(messages.error(6, 422, "q: nope", 1.0)) == \
        messages.WorkerReply(422, None, "q: nope", 1.0, id=6)


def test_an_untraced_request_frame_carries_no_trace_id() -> None:
    """The access log's `-` (no trace) or anything else that is not a W3C id stays home."""
    for not_a_trace in ("", "-", TRACE.upper(), "0" * 32, TRACE[:31]):
        frame = messages.request(1, b"{}", "r", not_a_trace)
        assert "trace_id" not in frame
        assert messages.from_front(frame) == messages.Request(1, b"{}", "r", "")


@pytest.mark.parametrize("frame", [
    {"kind": "ready"},  # a worker-only kind, sent by the front
    {"kind": "request", "id": "7", "body": b"{}"},
    {"kind": "request", "id": 7, "body": "{}"},  # a body is always bytes
    {"kind": "request", "id": 7, "body": b"{}", "trace_id": 7},
    {"kind": "ping", "seq": True},
])
def test_front_frames_are_decoded_strictly(frame: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        messages.from_front(frame)


@pytest.mark.parametrize("frame", [
    {"kind": "request", "id": 1, "body": b"{}"},  # a front-only kind, sent by the worker
    {"kind": "response", "status": 200, "body": b"{}"},  # no id
    {"kind": "error", "id": 1, "status": 422},  # no detail
    {"kind": "pong"},
])
def test_worker_frames_are_decoded_strictly(frame: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        messages.from_worker(frame)


def test_clean_eof_between_frames_is_none() -> None:
    assert _read_both(b"") == [None, None]
    stream = io.BytesIO(encode_frame(messages.shutdown()))
    assert read_frame_blocking(stream) == {"kind": "shutdown"}
    assert read_frame_blocking(stream) is None


@pytest.mark.parametrize("cut", [1, 3, 4, 6])
def test_eof_inside_a_frame_is_truncated(cut: int) -> None:
    data = encode_frame({"kind": "ready", "pid": 1, "pad": "x" * 10})[:cut]
    with pytest.raises(FrameTruncated):
        read_frame_blocking(io.BytesIO(data))
    with pytest.raises(FrameTruncated):
        _read_async(data)
    with pytest.raises(FrameTruncated):
        _read_buffered(data, 1 << 20)


def test_oversize_is_refused_from_the_header_alone() -> None:
    # Only the header is present: a reader that tried to allocate or read the payload first
    # would report truncation instead.
    header = struct.pack(">I", (1 << 20) + 1)
    with pytest.raises(FrameTooLarge):
        read_frame_blocking(io.BytesIO(header), max_size=1 << 20)
    with pytest.raises(FrameTooLarge):
        _read_async(header, max_size=1 << 20)
    with pytest.raises(FrameTooLarge):
        _read_buffered(header, 1 << 20)


def test_encoder_refuses_oversize() -> None:
    with pytest.raises(FrameTooLarge):
        encode_frame({"kind": "x", "blob": b"0" * 100}, max_size=50)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"no": "kind"}),
        msgpack.packb({"kind": 5}),
        msgpack.packb({"kind": "x"}) + b"\x00",  # trailing bytes
    ],
)
def test_undecodable_payload(payload: bytes) -> None:
    data = struct.pack(">I", len(payload)) + payload
    with pytest.raises(FrameDecodeError):
        read_frame_blocking(io.BytesIO(data))
    with pytest.raises(FrameDecodeError):
        _read_async(data)


def test_ready_frame_round_trips_into_ready_info() -> None:
    info = messages.ReadyInfo(
        model="clef-flash", variant="clef-flash", device="cuda", dtype="bfloat16",
        gdn_path="fla", versions={"torch": "2.11.0"}, demo=False, snapshot="/srv/m",
        pid=42, thread="MainThread", warmup_ms=1234.5,
    )
    frame = read_frame_blocking(io.BytesIO(encode_frame(messages.ready(info))))
    assert frame is not None and frame["kind"] == "ready"
    assert messages.ReadyInfo.from_message(frame) == info


@pytest.mark.parametrize("broken", [{"pid": "x"}, {"pid": None}, {"versions": [1]}])
def test_malformed_ready_frame_is_a_value_error(broken: dict) -> None:
    frame = {**messages.ready(messages.ReadyInfo(
        model="m", variant="clef-flash", device="cpu", dtype="float32", gdn_path="torch",
        pid=1, thread="MainThread", warmup_ms=1.0)), **broken}
    with pytest.raises(ValueError, match="malformed ready frame"):
        messages.ReadyInfo.from_message(frame)


def test_ready_frame_without_a_field_is_a_value_error() -> None:
    frame = messages.ready(messages.ReadyInfo(model="m", variant="v", device="cpu",
                                              dtype="float32", gdn_path="torch"))
    del frame["pid"]
    with pytest.raises(ValueError, match="malformed ready frame"):
        messages.ReadyInfo.from_message(frame)


def test_prefix_cache_fields_round_trip() -> None:
    """`ready.prefix_cache` and `response.prefix` come back as the typed values they were built
    from; absent, they are None (a worker without a cache)."""
    cache = messages.PrefixCacheInfo(enabled=False, capacity_bytes=1 << 30, block_tokens=256,
                                     disabled_reason="self-check: prefixed probe disagreed")
    info = messages.ReadyInfo(model="m", variant="clef-flash", device="cpu", dtype="float32",
                              gdn_path="torch", pid=1, thread="MainThread", warmup_ms=1.0,
                              prefix_cache=cache)
    frame = read_frame_blocking(io.BytesIO(encode_frame(messages.ready(info))))
    assert frame is not None
    assert messages.ReadyInfo.from_message(frame).prefix_cache == cache
    stats = messages.PrefixStats(reused_tokens=512, bytes=4096, entries=3, hits=2, lookups=5,
                                 tokens_reused=1024)
    reply = messages.from_worker(messages.response(5, b"{}", 2.0, prefix=stats))
    assert isinstance(reply, messages.WorkerReply) and reply.prefix == stats
    plain = messages.from_worker(messages.response(5, b"{}", 2.0))
    assert isinstance(plain, messages.WorkerReply) and plain.prefix is None
    assert "prefix" not in messages.response(5, b"{}", 2.0)


@pytest.mark.parametrize("broken", [
    {"reused_tokens": -1}, {"bytes": "1"}, {"hits": True}, {"lookups": 1.5}, {"extra": 1},
])
def test_a_malformed_prefix_map_breaks_the_response(broken: dict) -> None:
    good = {"reused_tokens": 0, "bytes": 0, "entries": 0, "hits": 0, "lookups": 0,
            "tokens_reused": 0}
    frame = {**messages.response(1, b"{}", 1.0), "prefix": {**good, **broken}}
    with pytest.raises(ProtocolError, match="prefix"):
        messages.from_worker(frame)


@pytest.mark.parametrize("broken", [
    {"enabled": 1}, {"capacity_bytes": -1}, {"block_tokens": "256"}, {"disabled_reason": None},
])
def test_a_malformed_prefix_cache_map_breaks_ready(broken: dict) -> None:
    good = {"enabled": True, "capacity_bytes": 1, "block_tokens": 256, "disabled_reason": ""}
    frame = {**messages.ready(messages.ReadyInfo(
        model="m", variant="clef-flash", device="cpu", dtype="float32", gdn_path="torch",
        pid=1, thread="MainThread", warmup_ms=1.0)), "prefix_cache": {**good, **broken}}
    with pytest.raises(ValueError, match="malformed ready frame"):
        messages.ReadyInfo.from_message(frame)


def test_a_cache_off_by_flag_is_not_turned_off_but_one_the_check_disabled_is() -> None:
    """`turned_off` (what the alert watches) tells the self-check's disabling from the
    operator's flags."""
    def info(enabled: bool, reason: str) -> messages.PrefixCacheInfo:
        return messages.PrefixCacheInfo(enabled, 1 << 30, 256, reason)

    assert not info(True, "").turned_off
    assert not info(False, messages.PREFIX_CACHE_OFF_BY_FLAG).turned_off
    assert not info(False, messages.PREFIX_CACHE_NO_BYTES).turned_off
    assert info(False, "self-check: the prefixed probe differs by 0.2").turned_off
