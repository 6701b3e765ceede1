"""The built-in demo snapshot: a tiny random Clef model in the exact release layout.

`clef-serve --model demo` must start on a fresh machine with no download, and it must exercise
the same loading, encoding and scoring code as a real snapshot, so that a demo that works proves
the serving path works. That rules out a fake executor: instead this package *generates* a real
snapshot directory (config.json, model.safetensors, tokenizer.json, joint_head_config.json,
joint_head.safetensors, ...) whose weights are random. Its answers are meaningless; its
arithmetic is real.

Generation is deterministic (fixed seeds, one RNG stream per tensor keyed by the tensor's name,
tokenizer trained on a built-in corpus), so the same library versions always produce the same
bytes, and it happens once per cache (see `cache`).

| module | job |
|---|---|
| `spec` | shape parameters (`DemoSpec`) and the generator format |
| `tokenizer` | the byte-level BPE trained on a built-in corpus, with Qwen3.5's special tokens |
| `layout` | tensor names, shapes and init kinds, from transformers' model and `JointSchemaHead` |
| `weights` | one random tensor per layout entry, stored in BF16 |
| `generate` | writes a snapshot directory |
| `cache` | generate once, publish atomically, reuse |

None of it runs when serving a real snapshot: `clef_worker.loading` imports this package only
for `--model demo`.
"""

from __future__ import annotations

from clef_worker.demo.cache import (
    CACHE_ENV,
    default_cache_root,
    demo_snapshot_name,
    ensure_demo_snapshot,
)
from clef_worker.demo.generate import generate_snapshot, snapshot_files
from clef_worker.demo.spec import DEMO_FORMAT, DemoSpec

__all__ = [
    "CACHE_ENV",
    "DEMO_FORMAT",
    "DemoSpec",
    "default_cache_root",
    "demo_snapshot_name",
    "ensure_demo_snapshot",
    "generate_snapshot",
    "snapshot_files",
]
