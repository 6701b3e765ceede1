"""`--log-format json`: every stderr line of the front and the workers is one JSON object.

The formatter and the stray-output wrapper are checked on their own; then the whole server runs
(the fake worker for the per-request worker lines and the stray writes, the real worker on the
tiny snapshot for its start-up and the model libraries' lines) and every line it wrote must
parse, the access line carrying the request id and the trace id.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from clef_protocol.logfmt import FIELDS, JsonFormatter, JsonLinesStream, utc_stamp
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Serve, clef_body

TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE}-b7ad6b7169203331-01"
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _record(message: str, *args: object, **attributes: Any) -> logging.LogRecord:
    record = logging.LogRecord("clef_frontend.x", logging.WARNING, __file__, 1, message, args,
                               None)
    record.__dict__.update(attributes)
    return record


def test_a_record_becomes_one_object_with_the_agreed_keys() -> None:
    record = _record("queue is %s", "full", request_id="r-1", trace_id=TRACE,
                     **{FIELDS: {"status": 503, "path": "/v1/systemone"}})
    line = JsonFormatter().format(record)
    assert "\n" not in line
    document = json.loads(line)
    assert list(document)[:4] == ["time", "level", "logger", "message"]
    assert STAMP.match(document["time"])
    assert document | {"time": None} == {
        "time": None, "level": "WARNING", "logger": "clef_frontend.x",
        "message": "queue is full", "request_id": "r-1", "trace_id": TRACE, "status": 503,
        "path": "/v1/systemone"}


def test_a_traceback_stays_inside_the_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]


def test_utc_stamp() -> None:
    assert utc_stamp(86400.042) == "1970-01-02T00:00:00.042Z"


def test_stray_output_is_wrapped_line_by_line() -> None:
    target = io.StringIO()
    stream = JsonLinesStream(target, "stderr")
    stream.write("Some weights were not used\nhalf a ")
    stream.write('line\n{"already": "json"}\n\n')
    stream.write("no newline at exit")
    stream.close()
    lines = [json.loads(line) for line in target.getvalue().splitlines()]
    assert [line.get("message", line) for line in lines] == [
        "Some weights were not used", "half a line", {"already": "json"},
        "no newline at exit"]
    assert lines[0]["logger"] == "stderr" and lines[0]["level"] == "WARNING"


# -- the whole server ---------------------------------------------------------------------------


def _parse_all(lines: list[str]) -> list[dict[str, Any]]:
    documents = []
    for line in lines:
        try:
            document = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
        assert isinstance(document, dict), line
        assert {"time", "level", "logger", "message"} <= document.keys(), line
        documents.append(document)
    return documents


def _access(documents: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    found = [d for d in documents
             if d["logger"] == "clef_frontend.access" and d.get("request_id") == request_id]
    assert len(found) == 1, documents
    return found[0]


def test_front_and_fake_worker_lines_are_all_json(tmp_path: Path) -> None:
    ok_body = clef_body()
    with Serve(front_args=("--log-format", "json")) as serve:
        ok = serve.post(ok_body, headers=[("X-Request-Id", "json-ok"),
                                              ("traceparent", TRACEPARENT)])
        failed = serve.post(clef_body(error="device fault", error_status=500),
                            headers=[("X-Request-Id", "json-500")])
        traced = serve.post(clef_body(error="device fault", error_status=500),
                            headers=[("X-Request-Id", "json-500-traced"),
                                     ("traceparent", TRACEPARENT)])
        chatty = serve.post(clef_body(print=True), headers=[("X-Request-Id", "json-print")])
        assert (ok.status, failed.status, traced.status, chatty.status) == (200, 500, 500, 200)
        serve.wait_for(r'"request_id": "json-print"')
        serve.terminate()
        assert serve.wait_exit() == 0
        documents = _parse_all(serve.lines)
    line = _access(documents, "json-ok")
    assert line["trace_id"] == TRACE
    assert line | {"time": None, "queue_ms": None, "worker_ms": None, "client": None} == {
        "time": None, "level": "INFO", "logger": "clef_frontend.access", "message": "request",
        "request_id": "json-ok", "trace_id": TRACE, "method": "POST",
        "path": "/v1/systemone", "status": 200, "queue_ms": None, "worker_ms": None,
        "batch": 1, "bytes_in": len(ok_body), "bytes_out": len(ok.body), "client": None,
        "key": "-", "cache": "miss", "tenant": "-", "weights": None, "reused": None}
    assert isinstance(line["queue_ms"], float) and isinstance(line["worker_ms"], float)
    assert _access(documents, "json-500")["trace_id"] == "-"
    # The worker's own lines about the failed requests carry their request ids, and the traced
    # one its W3C trace id (sent in the request frame), so the worker's line joins the trace.
    worker = [d for d in documents if d["logger"] == "fake_worker"]
    assert [(d.get("request_id"), d.get("trace_id")) for d in worker] == [
        ("json-500", None), ("json-500-traced", TRACE)]
    assert worker[0]["message"].endswith("failed: device fault")
    # A library's print (redirected to stderr by the worker) became a line of its own.
    assert any(d["logger"] == "stdout" and d["message"] == "library chatter on stdout"
               for d in documents)
    assert any("listening on http://" in d["message"] for d in documents)


def test_real_worker_lines_are_all_json() -> None:
    if not TINY_SNAPSHOT.is_dir():
        pytest.fail(f"test fixture missing: {TINY_SNAPSHOT}")
    with Serve(real_worker=True, startup_wait=240, front_args=(
            "--model", str(TINY_SNAPSHOT), "--device", "cpu", "--log-format", "json")) as serve:
        response = serve.post(clef_body(), headers=[("X-Request-Id", "real-json"),
                                                    ("traceparent", TRACEPARENT)])
        assert response.status == 200
        serve.wait_for(r'"request_id": "real-json"')
        serve.terminate()
        assert serve.wait_exit(60) == 0
        documents = _parse_all(serve.lines)
    line = _access(documents, "real-json")
    assert (line["status"], line["trace_id"]) == (200, TRACE)
    loggers = {d["logger"] for d in documents}
    assert any(name.startswith("clef_worker") for name in loggers), loggers
    assert any(name.startswith("clef_frontend") for name in loggers), loggers


def test_a_stuck_workers_stack_reaches_the_json_log() -> None:
    """`--log-format json` with a worker wedged in a request (`--stall-timeout 1`, the subject):
    the stack it writes before the kill comes out as JSON lines like everything else."""
    with Serve(front_args=("--log-format", "json", "--stall-timeout", "1")) as serve:
        pid = serve.health().json()["worker"]["pid"]
        assert serve.post(clef_body(wedge=True)).status == 500
        serve.wait_for(rf'"message": "worker pid={pid} failed ')
        serve.terminate()
        assert serve.wait_exit() == 0
        documents = _parse_all(serve.lines)
    messages = [d["message"] for d in documents]
    assert any(m.startswith(f"worker pid={pid} is stuck: asking for its stack") for m in messages)
    # The front writes its own lines at the end of an event-loop turn, so its "is stuck" may
    # follow the worker's first stack lines; the stack comes between the worker's ready and
    # its failure.
    ready = next(i for i, m in enumerate(messages)
                 if m.startswith("worker ready:") and f" pid={pid} " in m)
    failed = next(i for i, m in enumerate(messages) if m.startswith(f"worker pid={pid} failed"))
    stack = messages[ready:failed]
    assert any("most recent call first" in m for m in stack), stack
    assert any(re.search(r'fake_worker\.py", line \d+ in answer', m) for m in stack), stack
