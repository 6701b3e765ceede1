"""The Clef-Flash model itself: everything from a snapshot on disk to an answer's bytes.

Nothing here knows about frames, the serve loop or batching policy; the executors
(`clef_worker.native`, `clef_worker.release`) compose these modules. A model module that cannot
start raises `clef_worker.errors.StartupError`; a refused request raises
`clef_protocol.errors.RequestInvalid`.

| module | job |
|---|---|
| `snapshot` | locate and check a release snapshot before anything loads (spec §1) |
| `kernel_advice` | keep transformers' kernel advice out of the log where it cannot apply |
| `swap` | replace a kernel function transformers' Qwen3.5 module looks up at call time |
| `gated_delta` | the CPU Gated DeltaNet prefill (small chunks, plain torch) |
| `backbone` | the Qwen3.5 text stack: choose the kernel, build, load, run |
| `short_conv` | the layers' short convolution on CUDA (fla's Triton kernel) |
| `encoding` | a request → the token sequence the model was trained on (spec §3) |
| `head` | the joint schema head, batched over questions, options and requests (spec §4) |
| `answers` | per-option probabilities → the response body (spec §5) |
"""
