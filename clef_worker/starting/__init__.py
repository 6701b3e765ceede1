"""The worker's start-up wing: everything that runs once, before `ready`, and never on a
request's path. It sits above the serving wing (it warms and checks the runner serving uses)
and below the process (`clef_worker.main`), so a newcomer reading how a request is answered can
skip it, and one reading how a worker starts reads it top to bottom:

| module | job |
|---|---|
| `startup_clock` | each start-up phase's seconds and `ready_s` for `ready`, `/health` and the log |
| `kernel_cache` | Triton's and fla's compiled kernels kept per GPU, libraries and dimensions |
| `warm_requests` | the warm-up requests derived from the limits, and the `WarmTarget` protocol |
| `warmup` | the warm-up sequence: capture every shape, first touches, the prefix kernels |
| `self_check` | the start-up check: every probe through the serving path against the reference |
| `self_check_paths` | the serving paths the check can fall back along, in order |
| `self_check_requests` | the probes' requests and the groups and shapes they force |
| `self_check_compare` | one probe's answers against the reference's, within the bounds |
| `self_check_reference` | the reference: one request at a time, on the kernels serving compiled |
| `variant_probe` | the reference runner for a fine-tuned variant's slots |
| `prefix_probe` | the prefix cache checked through a cached prefix, sized to `--max-length` |
| `check_probes` | every probe in the order run: the check and the kept verdict's key read it |
| `verdict_store` | a passing verdict kept and reused while weights, code and settings stay |
"""
