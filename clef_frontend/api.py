"""The client-facing surface around the contract's routes: keys, model names, envelope.

One object the connection consults at two points, so the connection's loop stays the contract's
loop:
- `decide_from_head`, right after routing and before any body byte is read: the API key (401),
  the Workers-AI model name (404), and `GET /v1/models`, answered from memory;
- `finish`, on every reply about to be sent: a Workers-AI target gets Cloudflare's envelope,
  whatever stage produced the reply.
`/health` stays open for probes and is never enveloped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clef_frontend import workers_ai
from clef_frontend.auth import ApiKeys
from clef_frontend.catalogue import Catalogue
from clef_frontend.responses import Reply
from clef_frontend.routes import Route


@dataclass(frozen=True)
class ApiSurface:
    """The keys in force and the names served; the defaults are auth off, `clef-flash`."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    catalogue: Catalogue = field(default_factory=lambda: Catalogue(("clef-flash",)))

    def decide_from_head(
        self, found: Route, target: bytes, authorization: bytes | None
    ) -> Reply | None:
        """The reply the head alone decides for a key-protected route, or None to go on."""
        if found is Route.HEALTH:
            return None
        denied = self.keys.check(authorization)
        if denied is not None:
            return denied
        if found is Route.MODELS:
            return self.catalogue.reply()
        if found is Route.WORKERS_AI:
            run = workers_ai.run_target(target)
            assert run is not None  # the route matched this target
            return workers_ai.check_model(run, self.catalogue)
        return None

    def check_body_model(self, target: bytes, request: dict[str, object]) -> Reply | None:
        """Once the body is valid: its `model` against the variants served
        (`Catalogue.check_body_model`; the Workers-AI path's model beside it)."""
        run = workers_ai.run_target(target)
        path_model = run.model_id.removeprefix(workers_ai.MODEL_PREFIX) if run else None
        return self.catalogue.check_body_model(request.get("model"), path_model)

    def finish(self, target: bytes | None, reply: Reply) -> Reply:
        """The reply as the route's clients expect it: enveloped on the Workers-AI route."""
        if target is not None and workers_ai.run_target(target) is not None:
            return workers_ai.envelope(reply)
        return reply
