"""`clef-batch` output lines, in OpenAI's batch output shape, and the file they are appended to.

Each line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error",
"weights"}`: an answered job (whatever its status, as OpenAI does for a 4xx) has a `response`
and a null `error`; a line that was no job has a null `response` and an `error` with a `code`,
a `message` naming its line, and the `line` itself (the key resume uses when no custom_id could
be read). `weights` is the content fingerprint of the model that scored the answer (the
worker's `Weights`, as `Clef-Weights` names it in full), null where no model scored it (a bad
line, a request the checks refused, a worker's error): a resumed run compares them with the
weights it serves (clef_tools.resume).

Lines are written whole and flushed one by one, so a process killed at any instant leaves every
answer before the last one complete; at worst the last line is torn, and resume drops it.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import IO

from clef_api.responses import Reply
from clef_tools.batch_input import BadLine


def new_request_id() -> str:
    """An id for one answer: its `id`, `request_id`, and the worker's trace id (log lines)."""
    return f"batch_req_{uuid.uuid4().hex}"


def answered_line(custom_id: str, request_id: str, reply: Reply, weights: str = "") -> bytes:
    """An answer, scored by the weights `weights` ("": none scored it); the body is inserted as
    the front would send it, never re-serialised.

    The keys are ASCII-escaped: a custom_id read from a line that is not UTF-8 keeps its odd
    bytes as escapes rather than making the output unreadable.
    """
    head = json.dumps({"id": request_id, "custom_id": custom_id})[:-1]
    return (f'{head}, "response": {{"status_code": {reply.status}, '
            f'"request_id": {json.dumps(request_id)}, "body": '.encode()
            + reply.body + b'}, "error": null, "weights": '
            + json.dumps(weights or None).encode() + b'}\n')


def bad_line(bad: BadLine) -> bytes:
    """A line that could not be run as a job."""
    record = {"id": new_request_id(), "custom_id": bad.custom_id, "response": None,
              "error": {"code": bad.code, "message": bad.message, "line": bad.line},
              "weights": None}
    return json.dumps(record).encode() + b"\n"


class OutputFile:
    """The output, opened for appending; each line is flushed to the OS as it is written."""

    def __init__(self, path: Path) -> None:
        self._stream: IO[bytes] = path.open("ab")

    def write(self, line: bytes) -> None:
        self._stream.write(line)
        self._stream.flush()

    def close(self) -> None:
        """Flush to disk and close (a finished run survives a power cut, not only a kill)."""
        self._stream.flush()
        os.fsync(self._stream.fileno())
        self._stream.close()
