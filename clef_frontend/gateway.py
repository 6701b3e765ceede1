"""The inference gateway's request headers that clef reads for its logs: who the tenant is.

Behind the Gateway API Inference Extension (the llm-d router's endpoint picker), a client, or
the gateway on its behalf, names its tenant with `x-llm-d-inference-fairness-id`: the flow that
the picker's flow control keeps fair against the others. Clef does not schedule by it (the
picker does); it writes it as `tenant=` on the request's access-log line and as the
`clef.tenant` attribute of its span, so an operator can see whose requests a replica served.

The value is client text bound for a `key=value` log line, so it is taken only when it is one
safe token: printable ASCII without spaces, at most 128 characters (the rule `X-Request-Id`
follows, clef_protocol.messages.is_request_id); anything else is logged as `-` (none), never
refused: the header is the gateway's business, not a request error.
"""

from __future__ import annotations

from clef_protocol.messages import is_request_id

FAIRNESS_HEADER = b"x-llm-d-inference-fairness-id"
NO_TENANT = "-"


def tenant_of(value: bytes | None) -> str:
    """The tenant named by the fairness-id header, or `-` when absent or not one safe token."""
    if value is None:
        return NO_TENANT
    text = value.decode("latin-1").strip()
    return text if is_request_id(text) else NO_TENANT
