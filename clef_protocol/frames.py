"""Length-prefixed msgpack frames: a 4-byte big-endian unsigned length, then one msgpack map.

Why length prefixes rather than newline-delimited JSON: request and response bodies travel as raw
bytes (so the front can forward the worker's JSON byte for byte), and a reader can check the size
before it allocates anything.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, BinaryIO

import msgpack

from clef_protocol.errors import ProtocolError

HEADER = struct.Struct(">I")
# Large enough for an 8 MiB request body plus envelope; every limit flag is checked against it.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class FrameError(ProtocolError):
    """The byte stream does not hold a valid frame; the channel cannot be trusted any more."""


class FrameTruncated(FrameError):
    """The stream ended inside a frame (after part of its header or payload)."""


class FrameTooLarge(FrameError):
    """The announced length is above the maximum; nothing was allocated for it."""


class FrameDecodeError(FrameError):
    """The payload is not one msgpack map."""


def encode_frame(message: dict[str, Any], max_size: int = MAX_FRAME_BYTES) -> bytes:
    """Serialise one message as header + payload."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_size:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the maximum of {max_size}")
    return HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    """Decode a frame's payload, insisting on a single map with a string `kind`."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise FrameDecodeError(f"undecodable frame payload: {exc}") from exc
    if not isinstance(message, dict):
        raise FrameDecodeError(f"frame payload is a {type(message).__name__}, not a map")
    if not isinstance(message.get("kind"), str):
        raise FrameDecodeError("frame payload has no string 'kind'")
    return message


def _check_length(header: bytes, max_size: int) -> int:
    (length,) = HEADER.unpack(header)
    if length > max_size:
        raise FrameTooLarge(f"announced frame of {length} bytes exceeds the maximum of {max_size}")
    return length


async def read_frame(
    reader: asyncio.StreamReader, max_size: int = MAX_FRAME_BYTES
) -> dict[str, Any] | None:
    """Read one frame from an asyncio stream; None on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameTruncated(f"stream ended after {len(exc.partial)} header bytes") from exc
    length = _check_length(header, max_size)
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameTruncated(
            f"stream ended after {len(exc.partial)} of {length} payload bytes"
        ) from exc
    return decode_payload(payload)


class FrameBuffer:
    """Incremental decoding for a reader driven by callbacks (an asyncio protocol).

    `feed` the bytes as they come, then take whole frames with `next_frame` until it returns
    None; `end` at end of stream raises FrameTruncated if the stream stopped inside a frame.
    Length checks happen on the header, before the payload is waited for, as in `read_frame`.
    """

    def __init__(self, max_size: int = MAX_FRAME_BYTES) -> None:
        self._max_size = max_size
        self._buffer = bytearray()
        self._length: int | None = None  # the current frame's length, once its header is in

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_frame(self) -> dict[str, Any] | None:
        """The next whole frame's message, None until more bytes arrive; FrameError if bad."""
        if self._length is None:
            if len(self._buffer) < HEADER.size:
                return None
            self._length = _check_length(bytes(self._buffer[:HEADER.size]), self._max_size)
            del self._buffer[:HEADER.size]
        if len(self._buffer) < self._length:
            return None
        payload = bytes(self._buffer[:self._length])
        del self._buffer[:self._length]
        self._length = None
        return decode_payload(payload)

    def end(self) -> None:
        """The stream ended: FrameTruncated unless it ended between frames."""
        if self._length is not None:
            raise FrameTruncated(
                f"stream ended after {len(self._buffer)} of {self._length} payload bytes")
        if self._buffer:
            raise FrameTruncated(f"stream ended after {len(self._buffer)} header bytes")


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame_blocking(
    stream: BinaryIO, max_size: int = MAX_FRAME_BYTES
) -> dict[str, Any] | None:
    """Read one frame from a blocking binary stream; None on a clean end of stream."""
    header = _read_exactly(stream, HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise FrameTruncated(f"stream ended after {len(header)} header bytes")
    length = _check_length(header, max_size)
    payload = _read_exactly(stream, length)
    if len(payload) < length:
        raise FrameTruncated(f"stream ended after {len(payload)} of {length} payload bytes")
    return decode_payload(payload)


def write_frame_blocking(stream: BinaryIO, message: dict[str, Any]) -> None:
    """Write one frame and flush it, so the peer sees it at once."""
    stream.write(encode_frame(message))
    stream.flush()


def write_frames(stream: BinaryIO, frames: list[bytes]) -> None:
    """Write encoded frames in one write and flush: the peer reads them together and handles
    them in one wake-up (the front then sends the requests they let through in one write)."""
    if frames:
        stream.write(b"".join(frames))
        stream.flush()
