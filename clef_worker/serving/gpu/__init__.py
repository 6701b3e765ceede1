"""The GPU path: fixed shapes so forwards can be captured and replayed.

Every module here also runs on CPU (eagerly), which is how CI tests its logic.

| module | job |
|---|---|
| `buckets` | the length and total-token buckets: a finite set of shapes |
| `capture` | how a fixed-shape forward is recorded (CUDA graphs, or eagerly) |
| `graphs` | padded `[rows, tokens]` shapes: static buffers, capture at warm-up, replay |
| `packed_graphs` | packed rows: one graph per total-token bucket, requests back to back |
| `state_buffers` | the per-sequence state inputs the packed buckets take (prefix cache) |
| `sync_guard` | a dispatch mode that refuses host syncs inside what a capture records |
| `transfer` | one packed host-to-device copy per forward for every integer tensor |
"""
