"""The worker loop and its stdio guard, independent of any model."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from clef_protocol import messages
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.frames import encode_frame, read_frame_blocking
from clef_protocol.messages import ModelInfo
from clef_worker.errors import ExecutorBroken
from clef_worker.executor import Answer
from clef_worker.main import handle_request, serve

REPO = Path(__file__).resolve().parent.parent


class ScriptedExecutor:
    """Answers by the request's `do` key; records the thread each call ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def describe(self) -> ModelInfo:
        return ModelInfo(model="t", variant="clef-flash", device="cpu", dtype="float32",
                            gdn_path="torch")

    def warm_up(self) -> None:
        pass

    def answer(self, body: bytes) -> Answer:
        self.threads.append(threading.current_thread().name)
        do = json.loads(body).get("do")
        if do == "invalid":
            raise RequestInvalid("q: nope")
        if do == "badjson":
            raise BadRequestBody("request must be a JSON object")
        if do == "boom":
            raise RuntimeError("secret internal detail")
        if do == "poisoned":
            raise ExecutorBroken("CUDA error: an illegal memory access was encountered")
        return Answer(b'{"echo":' + body + b"}", input_tokens=len(body),
                      truncated_tokens=int(do == "cut"))


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
    assert reply["worker_ms"] >= 0


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
    code = serve(ScriptedExecutor(), _frames(
        messages.request(1, b'{"do": "poisoned"}'),
        messages.request(2, b'{"n": 2}'),  # never reaches the broken executor
    ), out)
    assert code == 3
    stream = io.BytesIO(out.getvalue())
    reply = read_frame_blocking(stream)
    assert reply is not None
    assert (reply["id"], reply["status"], reply["detail"]) == (1, 500, "inference failed")
    assert read_frame_blocking(stream) is None


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

