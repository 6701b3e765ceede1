"""The client-facing surface around the contract's routes: keys, model list, envelope.

One object the connection consults at two points, so the connection's loop stays the contract's
loop:
- `decide_from_head`, right after routing and before any body byte is read: the API key (401)
  and `GET /v1/models`, answered from memory (the Workers-AI model name, 404, is the request
  checks' first stage, `clef_api.checks.RequestRules.check_target`, which the pipeline runs
  next);
- `finish`, on every reply about to be sent: a Workers-AI target gets Cloudflare's envelope,
  whatever stage produced the reply.
`/health` stays open for probes and is never enveloped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clef_api import workers_ai
from clef_api.catalogue import Catalogue
from clef_api.responses import Reply
from clef_api.routes import Route
from clef_frontend.auth import ApiKeys


@dataclass(frozen=True)
class ApiSurface:
    """The keys in force and the names served; the defaults are auth off, `clef-flash`."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    catalogue: Catalogue = field(default_factory=lambda: Catalogue(("clef-flash",)))

    def decide_from_head(self, found: Route, authorization: bytes | None) -> Reply | None:
        """The reply the key and the route alone decide, or None to go on."""
        if found is Route.HEALTH:
            return None
        denied = self.keys.check(authorization)
        if denied is not None:
            return denied
        if found is Route.MODELS:
            return self.catalogue.reply()
        return None

    def finish(self, target: bytes | None, reply: Reply) -> Reply:
        """The reply as the route's clients expect it: enveloped on the Workers-AI route."""
        if target is not None and workers_ai.run_target(target) is not None:
            return workers_ai.envelope(reply)
        return reply
