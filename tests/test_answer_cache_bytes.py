"""The answer cache's byte count is what its entries really cost: `clef_answer_cache_bytes`
(`AnswerCache.size_bytes`) against the memory tracemalloc sees the same entries take, for
replies decoded from real worker frames (as the front keeps them), with and without stage
timings, small and large bodies."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import tracemalloc

import pytest

from clef_dispatch import Answer
from clef_frontend.answer_cache import AnswerCache, Kept, entry_bytes
from clef_protocol import messages
from clef_protocol.frames import decode_payload, encode_frame

ENTRIES = 2000
FRAME_HEAD = 4  # the length prefix `encode_frame` puts before the msgpack payload


def _payloads(body_bytes: int, stages: bool) -> list[bytes]:
    """The msgpack payloads of ENTRIES distinct worker responses, each number distinct (as
    real ones are: no object the interpreter shares)."""
    payloads = []
    for number in range(ENTRIES):
        body = b'{"answers": "' + (b"%08d" % number) * (body_bytes // 8) + b'"}'
        frame = messages.response(
            100_000 + number, body, 12.5 + number, input_tokens=400 + number, batch_size=3,
            stages={"encode_ms": 1.5 + number, "forward_ms": 9.25 + number,
                    "head_ms": 0.5 + number} if stages else None)
        payloads.append(encode_frame(frame)[FRAME_HEAD:])
    return payloads


@pytest.mark.parametrize("body_bytes", [64, 2048, 32768])
@pytest.mark.parametrize("stages", [True, False], ids=["stages", "no-stages"])
def test_kept_bytes_are_what_the_entries_cost_in_memory(body_bytes: int, stages: bool) -> None:
    async def scenario() -> tuple[int, int, int]:
        cache = AnswerCache(ENTRIES, max_bytes=1 << 40)
        payloads = _payloads(body_bytes, stages)
        keys = [hashlib.sha256(b"%d" % number).digest() for number in range(ENTRIES)]
        replies = [messages.from_worker(decode_payload(payload)) for payload in payloads[:1]]
        assert isinstance(replies[0], messages.WorkerReply)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for key, payload in zip(keys, payloads, strict=True):
                reply = messages.from_worker(decode_payload(payload))
                assert isinstance(reply, messages.WorkerReply)
                cache._keep(key, Kept(Answer(reply)))  # what landing a 200 does
            del reply
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # The keys were made before tracing began; the cache holds them, so they count too.
        traced += sum(key.__sizeof__() for key in keys)
        bodies = sum(len(entry.answer.reply.body or b"") for entry in cache._answers.values())
        return cache.size_bytes, traced, bodies

    counted, traced, bodies = asyncio.run(scenario())
    per_entry, real_per_entry = counted / ENTRIES, traced / ENTRIES
    # Within 5% of the overhead beyond the bodies: the count neither misses the reply's
    # objects nor invents them, whatever the body's size.
    overhead, real_overhead = per_entry - bodies / ENTRIES, real_per_entry - bodies / ENTRIES
    assert abs(overhead - real_overhead) <= 0.05 * real_overhead, (
        overhead, real_overhead)


def test_an_entry_costs_far_more_than_its_body_and_key() -> None:
    """The figure the docs state: a worker's reply with its stage timings costs about 750
    bytes beyond its body (the old count, body + 32, missed most of it)."""
    payload = _payloads(64, stages=True)[0]
    reply = messages.from_worker(decode_payload(payload))
    assert isinstance(reply, messages.WorkerReply) and reply.body is not None
    overhead = entry_bytes(b"k" * 32, Kept(Answer(reply))) - len(reply.body)
    assert 600 <= overhead <= 800, overhead
