"""The clef-serve front: an asyncio + h11 HTTP/1.1 server in front of persistent model workers.

The front owns sockets and HTTP; the workers and their queue are clef_dispatch's; each worker
process (one or more per device) owns a copy of the model and batches the requests it holds.
The front never imports torch (nor anything that pulls it in), so it starts in a fraction of a
second and stays responsive while workers load, crash or restart.

Data path, one module per step: connection (socket and timers) -> http1 (h11 events, no I/O)
-> pipeline (the request's steps, one declared list: routes and the ordered checks of
docs/http-contract.md, with traffic's key name, quota, class and deadline; body; validation and the
request's identity, with clef_api's checks) -> traffic / answer_cache (a kept answer, an
identical request in flight to join, or the first of its kind) -> clef_dispatch.Dispatcher (the
queue, the workers; an Answer or a Refusal) -> clef_api.responses (the outcome as HTTP).
"""
