"""clef_api: the HTTP API's rules as pure functions, shared by `clef-serve` and `clef-batch`.

Both drivers answer a scoring request the same way: the same route table, the same checks in
the order of docs/http-contract.md with the same status and `detail`, the same Workers-AI envelope.
Those rules live here, below both (`clef_frontend` adds the sockets, `clef_tools` the JSONL
files), so neither restates them and `clef_tools` imports nothing of the front:

| module | job |
|---|---|
| `routes.py` | the route table (404, 405) |
| `checks.py` | the request checks, in contract order: `RequestRules`, one function from route, |
|  | headers and body to a checked request or its refusal (`check`), made of the stages the |
|  | front runs one by one as the request streams in (target, head, body) |
| `framing.py` | the framing headers a request declared (Content-Length, Transfer-Encoding) |
| `workers_ai.py` | the Workers-AI route: its path, the model check and the envelope |
| `catalogue.py` | the model names served (`/v1/models`, the Workers-AI model check) and the |
|  | fine-tuned variants' (`--finetune`: a body's `model` must be one of them all, 404) |
| `responses.py` | `Reply`, and the reply each dispatch outcome gets |
| `truncation.py` | the header that says the state was cut |
"""
