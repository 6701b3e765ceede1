"""The Workers-AI route: `POST /accounts/{account_id}/ai/run/@cf/cloudflare/{model}`.

Clients written for Cloudflare's hosted Clef (clef-evals, clef-compactor, clef-router) call
this path and read Cloudflare's envelope. The body is a SystemOne request, checked and scored
exactly as on `/v1/systemone`; only the answer's shape differs:

- success: `{"result": <the SystemOne body, byte for byte>, "success": true, "errors": [],
  "messages": []}`;
- every error, at every stage (transport rows, 401, 404, 405, 422, 500, 503...): the same status
  and headers (`Retry-After`, `Allow`, `WWW-Authenticate`), with `{"result": null, "success":
  false, "errors": [{"code": <status>, "message": <detail>}], "messages": []}`.

The account id is taken as given: it selects nothing, and the access log shows it in the path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from http import HTTPStatus
from urllib.parse import unquote

from clef_api.catalogue import Catalogue
from clef_api.responses import Reply, error, json_bytes

PATH_TEMPLATE = "/accounts/{account_id}/ai/run/@cf/cloudflare/{model}"
MODEL_PREFIX = "@cf/cloudflare/"
# Any `/accounts/<id>/ai/run/<model id>` is this route; a query string makes it unknown, as on
# every other path (docs/http-contract.md: targets are compared as sent).
_RUN_PATH = re.compile(rb"/accounts/(?P<account>[^/?#]+)/ai/run/(?P<model>[^?#]+)")


@dataclass(frozen=True)
class RunTarget:
    account_id: str
    model_id: str  # percent-decoded: `%40cf/...` is `@cf/...`


def run_target(target: bytes) -> RunTarget | None:
    """The account and model of a Workers-AI run path, or None for any other target."""
    match = _RUN_PATH.fullmatch(target)
    if match is None:
        return None
    return RunTarget(
        account_id=match["account"].decode("latin-1"),
        model_id=unquote(match["model"].decode("latin-1")),
    )


def path_model(target: bytes) -> str | None:
    """The model a Workers-AI run path names (without `@cf/cloudflare/`), or None for any other
    target."""
    run = run_target(target)
    return run.model_id.removeprefix(MODEL_PREFIX) if run is not None else None


def route_path(target: bytes) -> bytes:
    """The path a metrics label may show: the route's template for a run path (account ids
    and model names come from clients and must not grow the label set), else the target."""
    return PATH_TEMPLATE.encode("ascii") if run_target(target) is not None else target


def check_model(target: RunTarget, catalogue: Catalogue) -> Reply | None:
    """None if the path names a model this server serves, else a 404 that lists them."""
    name = target.model_id.removeprefix(MODEL_PREFIX)
    if target.model_id.startswith(MODEL_PREFIX) and catalogue.knows(name):
        return None
    served = ", ".join(MODEL_PREFIX + known for known in catalogue.every_name)
    return error(404, f"unknown model {target.model_id!r}; this server runs {served}")


def envelope(reply: Reply) -> Reply:
    """The same reply in Cloudflare's envelope: status and headers kept, body wrapped."""
    if 200 <= reply.status < 300:
        # The SystemOne body is inserted as sent by the worker, never re-serialised.
        body = b'{"result": ' + reply.body + b', "success": true, "errors": [], "messages": []}'
    else:
        body = json_bytes({
            "result": None,
            "success": False,
            "errors": [{"code": reply.status, "message": _detail(reply)}],
            "messages": [],
        })
    return replace(reply, body=body)


def _detail(reply: Reply) -> str:
    """The error's detail text, whichever way the reply was built."""
    if reply.detail is not None:
        return reply.detail
    try:
        value = json.loads(reply.body)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("detail"), str):
        return value["detail"]
    try:
        return HTTPStatus(reply.status).phrase.lower()
    except ValueError:
        return "error"
