"""Priority classes: who is waiting for an answer (`interactive`) and who is not (`bulk`).

One owner for the class names and the `X-Clef-Priority` header's rule. A request's class is the
header's, else its key's default (the key file's `priority`), else `interactive`: a caller that
says nothing is assumed to have a person waiting, and floods are marked by the key that sends
them. Admission (admission.py) orders waiting requests by class.
"""

from __future__ import annotations

from clef_frontend import responses
from clef_frontend.responses import Reply

INTERACTIVE = "interactive"
BULK = "bulk"
CLASSES = (INTERACTIVE, BULK)
HEADER = b"x-clef-priority"


def check_class(value: str, where: str) -> str:
    """`value` if it names a class, else ValueError naming `where` it came from."""
    if value not in CLASSES:
        raise ValueError(f"{where}: priority {value!r} is not one of {', '.join(CLASSES)}")
    return value


def from_header(value: bytes | None, default: str) -> str | Reply:
    """The request's class from `X-Clef-Priority` (absent: `default`), or a 400 saying why."""
    if value is None:
        return default
    text = value.decode("latin-1").strip().lower()
    if text not in CLASSES:
        return responses.error(
            400, f"X-Clef-Priority must be one of {', '.join(CLASSES)}, got {text[:40]!r}")
    return text
