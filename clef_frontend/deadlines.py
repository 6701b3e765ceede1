"""Per-request deadlines: `X-Clef-Deadline-Ms` and `--queue-timeout`, as one point in time.

A request that is still waiting for a worker when its deadline passes is answered 504 and never
reaches a worker (admission.py keeps the timer): a client that gives up after N ms gains nothing
from an answer computed after that, and the worker's time goes to someone still waiting. A
request sharing an identical one's forward (answer_cache.py) is judged as it would be alone:
504 at its own deadline only while that forward still waits for a worker (the forward goes on
for the others), never once a worker holds it. The deadline runs from the end of the request
head, the moment the front knows it, so a slow body upload counts against it too.
"""

from __future__ import annotations

from clef_api import responses
from clef_api.responses import Reply

HEADER = b"x-clef-deadline-ms"
# The longest deadline a header may ask for (one day): beyond it the number is a mistake.
MAX_DEADLINE_MS = 86_400_000


def from_header(value: bytes | None, head_end: float) -> float | Reply | None:
    """The deadline (`time.monotonic()` seconds) `X-Clef-Deadline-Ms` sets, None without the
    header, or a 400 saying what is wrong with it."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    if not text.isdigit() or not 0 < int(text) <= MAX_DEADLINE_MS:
        return responses.error(
            400, f"X-Clef-Deadline-Ms must be a whole number of milliseconds from 1 to "
                 f"{MAX_DEADLINE_MS}, got {text[:40]!r}")
    return head_end + int(text) / 1000.0


