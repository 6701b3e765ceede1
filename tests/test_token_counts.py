"""The token counts a `response` frame carries from the worker to the front."""

from __future__ import annotations

import pytest

from clef_protocol import messages
from clef_protocol.errors import ProtocolError
from clef_protocol.messages import WorkerReply


def _reply_from(frame: dict[str, object]) -> WorkerReply:
    reply = messages.from_worker(frame)
    assert isinstance(reply, WorkerReply)
    return reply


def test_worker_reply_carries_token_counts() -> None:
    frame = messages.response(7, b"{}", 1.0, input_tokens=420, truncated_tokens=33)
    reply = _reply_from(frame)
    assert (reply.body, reply.input_tokens, reply.truncated_tokens) == (b"{}", 420, 33)


def test_absent_token_counts_read_as_zero() -> None:
    frame = messages.response(7, b"{}", 1.0, input_tokens=5, truncated_tokens=2)
    older = {key: value for key, value in frame.items()
             if key not in ("input_tokens", "truncated_tokens")}
    reply = _reply_from(older)
    assert (reply.input_tokens, reply.truncated_tokens) == (0, 0)


def test_batch_size_travels_and_reads_as_one_when_absent() -> None:
    assert _reply_from(messages.response(7, b"{}", 1.0, batch_size=12)).batch_size == 12
    older = {key: value for key, value in messages.response(7, b"{}", 1.0).items()
             if key != "batch_size"}
    assert _reply_from(older).batch_size == 1


@pytest.mark.parametrize("bad", ["3", 1.5, True, 0, -1, None])
def test_a_malformed_batch_size_breaks_the_channel(bad: object) -> None:
    with pytest.raises(ProtocolError, match="batch_size"):
        _reply_from({**messages.response(7, b"{}", 1.0), "batch_size": bad})


@pytest.mark.parametrize("bad", ["3", 1.5, True, -1, None])
@pytest.mark.parametrize("key", ["input_tokens", "truncated_tokens"])
def test_malformed_token_counts_break_the_channel(key: str, bad: object) -> None:
    frame = {**messages.response(7, b"{}", 1.0), key: bad}
    with pytest.raises(ProtocolError, match=key):
        _reply_from(frame)
