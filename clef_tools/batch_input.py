"""Reading a `clef-batch` input file: one job per line, or the reason a line is not one.

A line is `{"custom_id": "...", "body": {...}}`, or the OpenAI/vLLM batch shape that adds
`"method": "POST"` and `"url"` (a scoring route: `/v1/systemone` or the Workers-AI run path).
Why every line gets an outcome: a job file of a hundred thousand requests must not fail as a
whole for one bad line, and an operator must be able to see which lines were not answered and
why, so a line that is not a job becomes a `BadLine` (with its line number) that the output
records like an answer.

The body's own faults (duplicate keys, non-finite numbers, lone surrogates, excessive nesting)
are the API's 400s, not bad lines: a job whose custom_id can be read keeps the detail the HTTP
API would give for that body, found by the front's strict parser (`clef_protocol.body`) run over
the whole line. Python's `json` would silently accept all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_api.routes import Route, route
from clef_api.workers_ai import PATH_TEMPLATE
from clef_protocol.body import parse_body
from clef_protocol.errors import BadRequestBody

SYSTEMONE_PATH = Route.SYSTEMONE.path.decode("ascii")
SCORING_ROUTES = (Route.SYSTEMONE, Route.WORKERS_AI)


@dataclass(frozen=True)
class Job:
    """One request to answer: where it was, its key, its route and the body the worker gets."""

    line: int
    custom_id: str
    target: bytes
    body: bytes
    # The 400 detail the API gives this body (found by the strict parser), or None.
    body_error: str | None = None


@dataclass(frozen=True)
class BadLine:
    """A line that is not a job; `custom_id` is set when it could still be read."""

    line: int
    custom_id: str | None
    code: str
    message: str


@dataclass
class InputScan:
    """Every non-blank line of the input, as a job or a bad line, in file order."""

    jobs: list[Job]
    bad: list[BadLine]

    @property
    def lines(self) -> int:
        return len(self.jobs) + len(self.bad)


def _bad(number: int, custom_id: str | None, code: str, what: str) -> BadLine:
    return BadLine(number, custom_id, code, f"line {number}: {what}")


def parse_line(number: int, raw: bytes) -> Job | BadLine:
    """One input line (without its newline) as a job, or why it is not one."""
    # surrogateescape: a line that is not UTF-8 still yields its custom_id; its body is then
    # refused as the API refuses such a body (below), not dropped as unreadable.
    text = raw.decode("utf-8", errors="surrogateescape")
    try:
        envelope: Any = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return _bad(number, None, "invalid_json", f"not valid JSON ({exc})")
    if not isinstance(envelope, dict):
        return _bad(number, None, "invalid_line", "must be a JSON object with custom_id and body")
    custom_id = envelope.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _bad(number, None, "missing_custom_id", "custom_id must be a non-empty string")
    method = envelope.get("method", "POST")
    if method != "POST":
        return _bad(number, custom_id, "invalid_method", f"method must be POST, got {method!r}")
    url = envelope.get("url", SYSTEMONE_PATH)
    found = route(b"POST", url.encode("utf-8", "surrogateescape")) if isinstance(url, str) else None
    if found not in SCORING_ROUTES:
        return _bad(number, custom_id, "invalid_url",
                    f"url must be a scoring route ({SYSTEMONE_PATH} or {PATH_TEMPLATE}), "
                    f"got {url!r}")
    assert isinstance(url, str)
    if "body" not in envelope:
        return _bad(number, custom_id, "missing_body", "body is required")
    body_error = None
    try:
        parse_body(raw)
    except BadRequestBody as exc:
        body_error = str(exc)
    body = b"" if body_error else json.dumps(envelope["body"], ensure_ascii=False).encode()
    return Job(number, custom_id, url.encode("utf-8", "surrogateescape"), body, body_error)


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, bytes without the line ending) for every non-blank line."""
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, start=1):
            stripped = raw.rstrip(b"\r\n")
            if stripped.strip():
                yield number, stripped


def read_input(path: Path) -> InputScan:
    """Every line of `path` as a job or a bad line; a repeated custom_id is a bad line (the
    first occurrence is the job), so each custom_id names exactly one answer."""
    scan = InputScan([], [])
    first_seen: dict[str, int] = {}
    for number, raw in numbered_lines(path):
        parsed = parse_line(number, raw)
        custom_id = parsed.custom_id
        if custom_id is not None and custom_id in first_seen:
            scan.bad.append(_bad(number, None, "duplicate_custom_id",
                                 f"duplicate custom_id {custom_id!r} (first on line "
                                 f"{first_seen[custom_id]})"))
            continue
        if custom_id is not None:
            first_seen[custom_id] = number
        if isinstance(parsed, Job):
            scan.jobs.append(parsed)
        else:
            scan.bad.append(parsed)
    return scan
