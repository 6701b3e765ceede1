"""The API's checks on a job before the worker sees it, and the route's reply shape.

`clef-batch` must refuse exactly what the HTTP API refuses, with the same status and `detail`,
so it runs the API's own checks (`clef_api.checks.RequestRules.check`: the stages, in the order,
the front's pipeline runs one by one) rather than restating any rule; only a line whose body
cannot be a JSON body at all is refused here, after the target stage (400), since the API never
sees one.
"""

from __future__ import annotations

from dataclasses import dataclass

from clef_api import responses, workers_ai
from clef_api.checks import JSON_MEDIA_TYPE, RequestRules
from clef_api.framing import FramingHeaders
from clef_api.responses import Reply
from clef_tools.batch_input import Job

_JSON = JSON_MEDIA_TYPE.encode("ascii")


@dataclass(frozen=True)
class Screen:
    """The API's rules for the jobs of one run."""

    rules: RequestRules

    def refuse(self, job: Job) -> Reply | None:
        """The reply the API gives this job before forwarding it, or None to forward."""
        if job.body_error is not None:  # the model check still comes first, as on the server
            return self.rules.check_target(job.target) or responses.error(400, job.body_error)
        length = str(len(job.body)).encode("ascii")
        checked = self.rules.check(job.target, FramingHeaders((), (length,)), _JSON, job.body)
        return checked if isinstance(checked, Reply) else None


def finish(job: Job, reply: Reply) -> Reply:
    """The reply as the job's route answers it: Cloudflare's envelope on the Workers-AI route."""
    if workers_ai.run_target(job.target) is not None:
        return workers_ai.envelope(reply)
    return reply
