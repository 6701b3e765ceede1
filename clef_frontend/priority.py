"""Priority classes: who is waiting for an answer (`interactive`) and who is not (`bulk`).

One owner for the `X-Clef-Priority` header's rule (the class names are clef_dispatch's). A
request's class is the header's, else its key's default (the key file's `priority`), else
`interactive`: a caller that says nothing is assumed to have a person waiting, and floods are
marked by the key that sends them. Admission (admission.py) orders waiting requests by class.

Behind the inference gateway a client names an objective instead (`x-llm-d-inference-objective`,
an InferenceObjective with a priority, which the endpoint picker orders by). An operator may map
objective names to classes (`--objective-class NAME=CLASS`, none by default), so the few
requests that wait in a replica's own queue keep the order the picker gave them: the rule is
then `X-Clef-Priority`, else the mapped objective, else the key's default, else `interactive`.
An objective the map does not name is ignored (the gateway may serve objectives clef does not
know), never refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from clef_api import responses
from clef_api.responses import Reply
from clef_dispatch import BULK, CLASSES, INTERACTIVE

__all__ = ["BULK", "CLASSES", "HEADER", "INTERACTIVE", "OBJECTIVE_HEADER"]
HEADER = b"x-clef-priority"
# The objective header of the llm-d router (the Gateway API Inference Extension's endpoint
# picker); its value is an InferenceObjective's name.
OBJECTIVE_HEADER = b"x-llm-d-inference-objective"
# An InferenceObjective's name is a Kubernetes object name (an RFC 1123 subdomain).
_OBJECTIVE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")

ObjectiveClasses = Sequence[tuple[str, str]]


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


def parse_objective_class(text: str) -> tuple[str, str]:
    """`NAME=CLASS` (`--objective-class`): an objective's name and the class it maps to, or
    ValueError saying what is wrong."""
    name, equals, chosen = text.partition("=")
    if not equals or not _OBJECTIVE_NAME.fullmatch(name):
        raise ValueError(f"--objective-class expects NAME=CLASS with NAME an InferenceObjective "
                         f"name (lower-case letters, digits, '-', '.'), got {text!r}")
    return name, check_class(chosen, f"--objective-class {name}")


def check_objective_classes(pairs: ObjectiveClasses) -> None:
    """ValueError if one objective is mapped twice."""
    names = [name for name, _ in pairs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--objective-class maps {', '.join(twice)} more than once")


def from_objective(value: bytes | None, classes: ObjectiveClasses, default: str) -> str:
    """The class the operator mapped the request's objective to, else `default`."""
    if value is None or not classes:
        return default
    name = value.decode("latin-1").strip()
    for objective, chosen in classes:
        if objective == name:
            return chosen
    return default
