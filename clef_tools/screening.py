"""The front's checks on a job before the worker sees it, and the route's reply shape.

`clef-batch` must refuse exactly what the HTTP API refuses, with the same status and `detail`,
so it calls the front's own functions (docs/http-contract.md rows 5 and 8-12 through
`clef_frontend.routes`, the Workers-AI model check and envelope through
`clef_frontend.workers_ai`) rather than restating any rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from clef_frontend import responses, workers_ai
from clef_frontend.catalogue import Catalogue
from clef_frontend.config import ServerConfig
from clef_frontend.framing import FramingHeaders
from clef_frontend.responses import Reply
from clef_frontend.routes import check_body, check_post_head
from clef_protocol.options import RequestLimits
from clef_tools.batch_input import Job

_JSON = b"application/json"
# The front's own default body limit (413 above it), read from its config, not restated.
DEFAULT_BODY_LIMIT = ServerConfig(worker_argv=("-",)).body_limit


@dataclass(frozen=True)
class Screen:
    """What the front knows without the worker: the limits and the names it serves."""

    limits: RequestLimits
    catalogue: Catalogue
    body_limit: int = DEFAULT_BODY_LIMIT

    def refuse(self, job: Job) -> Reply | None:
        """The reply the front gives this job before forwarding it, or None to forward."""
        run = workers_ai.run_target(job.target)
        if run is not None:
            unknown = workers_ai.check_model(run, self.catalogue)
            if unknown is not None:
                return unknown
        if job.body_error is not None:
            return responses.error(400, job.body_error)
        length = str(len(job.body)).encode("ascii")
        head = check_post_head(FramingHeaders((), (length,)), _JSON, self.body_limit)
        if isinstance(head, Reply):
            return head
        checked = check_body(job.body, self.limits)
        if isinstance(checked, Reply):
            return checked
        path_model = run.model_id.removeprefix(workers_ai.MODEL_PREFIX) if run else None
        return self.catalogue.check_body_model(checked.get("model"), path_model)


def finish(job: Job, reply: Reply) -> Reply:
    """The reply as the job's route answers it: Cloudflare's envelope on the Workers-AI route."""
    if workers_ai.run_target(job.target) is not None:
        return workers_ai.envelope(reply)
    return reply
