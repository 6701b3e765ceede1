"""The token counts a `response` frame carries from the worker to the front."""

from __future__ import annotations

import pytest

from clef_frontend.worker_channel import WorkerFailure, _reply_from
from clef_protocol import messages


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


@pytest.mark.parametrize("bad", ["3", 1.5, True, -1, None])
@pytest.mark.parametrize("key", ["input_tokens", "truncated_tokens"])
def test_malformed_token_counts_break_the_channel(key: str, bad: object) -> None:
    frame = {**messages.response(7, b"{}", 1.0), key: bad}
    with pytest.raises(WorkerFailure, match=key):
        _reply_from(frame)
