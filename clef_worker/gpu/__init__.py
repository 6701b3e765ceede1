"""The GPU path: fixed shapes so forwards can be captured and replayed.

Every module here also runs on CPU (eagerly), which is how CI tests its logic.

| module | job |
|---|---|
| `buckets` | the padded length buckets: a finite set of sequence shapes |
| `graphs` | static input buffers per shape, CUDA-graph capture at warm-up, replay |
| `transfer` | one packed host-to-device copy per forward for every integer tensor |
"""
