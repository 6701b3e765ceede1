"""The clef-serve front: an asyncio + h11 HTTP/1.1 server in front of one persistent worker.

The front owns sockets, HTTP, request checks and the admission queue; the worker process owns
the model. The front never imports torch (nor anything that pulls it in), so it starts in a
fraction of a second and stays responsive while the worker loads, crashes or restarts.

Data path, one module per step: connection (socket -> h11) -> framing and routes (the ordered
checks of http-contract.md) -> admission (FIFO, one in flight) -> supervisor / worker_channel
(frames to and from the worker) -> responses (what goes back on the wire).
"""
