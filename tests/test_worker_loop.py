"""The worker loop and its stdio guard, independent of any model."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clef_protocol import messages
from clef_protocol.frames import encode_frame, read_frame_blocking
from clef_worker.main import reply_for, serve
from clef_worker.serving.batching import BatchingExecutor, answer_groups, as_batching
from clef_worker.serving.executor import Answer, Executor
from clef_worker.serving.policy import BatchPolicy
from tests.doubles import ScriptedExecutor

REPO = Path(__file__).resolve().parent.parent


WORKER_MS = 12.5  # what the serve loop measured for the request: every reply must carry it


def handle_request(executor: Executor | BatchingExecutor, request_id: int,
                   body: object) -> tuple[dict, bool]:
    """One request on the serve loop's path (its grouping and error mapping): the reply frame
    and whether the executor is broken."""
    [[(_, outcome)]] = list(answer_groups(as_batching(executor), [body], BatchPolicy()))
    return reply_for(request_id, outcome, WORKER_MS)


@pytest.mark.parametrize(
    ("do", "status", "detail"),
    [("invalid", 422, "q: nope"), ("badjson", 400, "request must be a JSON object"),
     ("boom", 500, "inference failed")],
)
def test_executor_exceptions_become_error_frames(do: str, status: int, detail: str) -> None:
    reply, broken = handle_request(ScriptedExecutor(), 9, json.dumps({"do": do}).encode())
    assert broken is False
    assert (reply["kind"], reply["id"], reply["status"], reply["detail"]) == (
        "error", 9, status, detail
    )
    assert reply["worker_ms"] == WORKER_MS  # an error reply still says how long it took


def test_internal_cause_goes_to_the_log_not_the_reply(caplog: pytest.LogCaptureFixture) -> None:
    reply, _ = handle_request(ScriptedExecutor(), 1, b'{"do": "boom"}')
    assert "secret" not in json.dumps(reply)
    assert "secret internal detail" in caplog.text


def test_success_carries_the_executor_bytes_unchanged() -> None:
    reply, broken = handle_request(ScriptedExecutor(), 3, b'{"b": 1,  "a": 2}')
    assert broken is False
    assert reply["kind"] == "response"
    assert reply["id"] == 3
    assert reply["status"] == 200
    assert reply["body"] == b'{"echo":{"b": 1,  "a": 2}}'
    assert reply["worker_ms"] == WORKER_MS
    assert (reply["input_tokens"], reply["truncated_tokens"]) == (len(b'{"b": 1,  "a": 2}'), 0)


def test_response_frame_carries_the_token_counts() -> None:
    body = b'{"do": "cut"}'
    reply, _ = handle_request(ScriptedExecutor(), 4, body)
    assert (reply["input_tokens"], reply["truncated_tokens"]) == (len(body), 1)


def _frames(*msgs: dict) -> io.BytesIO:
    return io.BytesIO(b"".join(encode_frame(m) for m in msgs))


def test_serve_answers_in_order_and_keeps_serving_after_failures() -> None:
    executor = ScriptedExecutor()
    out = io.BytesIO()
    code = serve(executor, _frames(
        messages.request(1, b'{"do": "boom"}'),
        messages.request(2, b'{"do": "invalid"}'),
        messages.request(3, b'{"n": 3}'),
        messages.shutdown(),
        messages.request(4, b'{"n": 4}'),  # after shutdown: never answered
    ), out)
    assert code == 0
    stream = io.BytesIO(out.getvalue())
    replies = []
    while (frame := read_frame_blocking(stream)) is not None:
        replies.append(frame)
    assert [(r["id"], r.get("status")) for r in replies] == [(1, 500), (2, 422), (3, 200)]
    assert executor.threads == ["MainThread"] * 3


def test_a_broken_executor_answers_500_then_the_worker_exits() -> None:
    out = io.BytesIO()
    executor = ScriptedExecutor()
    code = serve(executor, _frames(
        messages.request(1, b'{"do": "poisoned"}'),
        messages.request(2, b'{"n": 2}'),  # read with it, never reaches the broken executor
    ), out)
    assert code == 3
    replies = _replies(out)
    assert [(r["id"], r["status"], r["detail"]) for r in replies] == [
        (1, 500, "inference failed"), (2, 500, "inference failed")]
    assert len(executor.threads) == 1


def _replies(out: io.BytesIO) -> list[dict]:
    stream = io.BytesIO(out.getvalue())
    replies = []
    while (frame := read_frame_blocking(stream)) is not None:
        replies.append(frame)
    return replies


def test_every_ping_gets_its_pong_and_requests_are_not_held_up() -> None:
    """Pings before, between and after requests (one arriving while the requests are being
    gathered for one forward) are each answered with their own seq, and every request still
    gets its reply, in order."""
    out = io.BytesIO()
    code = serve(ScriptedExecutor(), _frames(
        messages.ping(1),
        messages.request(1, b'{"n": 1}'),
        messages.ping(2),
        messages.request(2, b'{"n": 2}'),
        messages.ping(3),
        messages.shutdown(),
    ), out)
    assert code == 0
    replies = _replies(out)
    assert sorted(r["seq"] for r in replies if r["kind"] == "pong") == [1, 2, 3]
    assert [(r["id"], r["status"]) for r in replies if r["kind"] != "pong"] == [(1, 200),
                                                                                (2, 200)]


def test_a_ping_waiting_during_a_forward_is_answered_before_the_next_forward() -> None:
    """Two requests read together run as two forwards (this executor does not batch); a ping
    that arrives during the first is answered before the second forward runs."""
    out = io.BytesIO()
    channel = _frames(messages.request(1, b'{"n": 1}'), messages.request(2, b'{"n": 2}'))

    class PingDuringFirst(ScriptedExecutor):
        def answer(self, body: bytes) -> Answer:
            if json.loads(body).get("n") == 1:  # the front pings while this forward runs
                position = channel.tell()
                channel.seek(0, io.SEEK_END)
                channel.write(encode_frame(messages.ping(7)))
                channel.seek(position)
            return super().answer(body)

    assert serve(PingDuringFirst(), channel, out) == 0
    kinds = [(r["kind"], r.get("seq", r.get("id"))) for r in _replies(out)]
    assert kinds == [("response", 1), ("pong", 7), ("response", 2)]


def test_a_ping_without_an_integer_seq_is_a_protocol_error() -> None:
    assert serve(ScriptedExecutor(), _frames({"kind": "ping", "seq": "x"}), io.BytesIO()) == 2


def test_worker_ms_counts_from_reading_the_frame_for_every_executor() -> None:
    """One meaning of worker_ms: the second of two requests read together waits for the
    first's forward, and its worker_ms says so (the adapted one-at-a-time executor here)."""

    class Slow(ScriptedExecutor):
        def answer(self, body: bytes) -> Answer:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.02:  # 20 ms of work, measured not slept
                pass
            return super().answer(body)

    out = io.BytesIO()
    assert serve(Slow(), _frames(messages.request(1, b"{}"), messages.request(2, b"{}")),
                 out) == 0
    first, second = _replies(out)
    assert first["worker_ms"] >= 20 and second["worker_ms"] >= first["worker_ms"] + 20
    assert first["batch_size"] == second["batch_size"] == 1
    assert "stages" not in first  # this executor does not time its stages


def test_serve_ends_cleanly_on_eof() -> None:
    assert serve(ScriptedExecutor(), _frames(messages.request(1, b"{}")), io.BytesIO()) == 0


def test_serve_exits_nonzero_on_a_broken_stream() -> None:
    assert serve(ScriptedExecutor(), io.BytesIO(b"\x00\x00\x00\x05\xc1"), io.BytesIO()) == 2


def test_serve_exits_nonzero_on_an_unexpected_kind() -> None:
    assert serve(ScriptedExecutor(), _frames({"kind": "ready"}), io.BytesIO()) == 2


def test_serve_exits_nonzero_on_a_request_without_an_integer_id() -> None:
    frame = {"kind": "request", "id": "7", "body": b"{}"}
    assert serve(ScriptedExecutor(), _frames(frame), io.BytesIO()) == 2


def test_a_request_frame_without_a_body_is_refused() -> None:
    reply, _ = handle_request(ScriptedExecutor(), 4, None)
    assert (reply["kind"], reply["id"], reply["status"]) == ("error", 4, 400)


def test_stdio_guard_keeps_library_output_off_the_channel() -> None:
    """print(), sys.stdout and raw writes to fd 1 after the claim all land on stderr."""
    script = textwrap.dedent(
        """
        import os, sys, subprocess
        from clef_worker.stdio import claim_channel
        from clef_protocol.frames import read_frame_blocking, write_frame_blocking
        channel_in, channel_out = claim_channel()
        print("library print")
        sys.stdout.write("sys.stdout write\\n")
        sys.stdout.flush()
        os.write(1, b"raw fd 1 write\\n")
        subprocess.run([sys.executable, "-c", "print('child print')"], check=True)
        assert sys.stdin.read() == ""  # fd 0 is no longer the channel
        message = read_frame_blocking(channel_in)
        write_frame_blocking(channel_out, {"kind": "response", "echo": message["body"]})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=encode_frame(messages.request(1, b"ping")),
        capture_output=True, cwd=REPO, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    stream = io.BytesIO(proc.stdout)
    assert read_frame_blocking(stream) == {"kind": "response", "echo": b"ping"}
    assert stream.read() == b""  # nothing but the one frame
    for line in ("library print", "sys.stdout write", "raw fd 1 write", "child print"):
        assert line in proc.stderr.decode()


def _run_worker(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "clef_worker", *args], input=stdin, capture_output=True,
        cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_missing_snapshot_is_a_fatal_frame_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    proc = _run_worker("--model", str(missing))
    assert proc.returncode == 1
    stream = io.BytesIO(proc.stdout)
    frame = read_frame_blocking(stream)
    assert frame is not None and frame["kind"] == "fatal"
    assert str(missing) in frame["reason"]
    assert stream.read() == b""

