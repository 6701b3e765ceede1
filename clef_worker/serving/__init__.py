"""The worker's serving wing: what runs for every request, from a group of prepared requests to
the head's scores. It sits below the start-up wing (`clef_worker.starting` warms and checks it)
and above the model (`clef_worker.model`), which knows nothing of groups, graphs or caches.

| module | job |
|---|---|
| `policy` | the batch policy resolved once from the flags: layout, token budget, window |
| `batching` | the serve loop: requests off the pipe, cut into groups, host work beside the device |
| `runner` | one group through the model: stage on the host, forward, head |
| `staging` | a group's run as data: what the host half stages, what the device half returns |
| `prefix/` | the prefix cache: keep the states of leading tokens, reuse them |
| `gpu/` | fixed shapes, CUDA-graph capture and replay, the state inputs of graphed forwards |
"""
