"""The start-up self-check's fine-tuned variants: which variant scores each probe request, and
the reference runner that answers them one by one.

Why: with `--finetune` served, a variant's answer goes through more than the base's: the
runner's per-token selection (where each request's tokens sit in a packed row, a padded shape
or a graph's static slot buffer) and the variant's own head. A wrong span or slot index scores
tokens with the wrong adapter and raises nothing; a probe of base requests only would pass it.
So, with variants served, the probe's requests take the base and each variant in turn (in
`--finetune` order): the mixed group mixes them in one forward, and at least one variant is
probed whatever the probe's size.

The reference for a variant request is the plain eager forward of that request alone with the
variant's adapters applied as segments (two thin matmuls per adapted layer, the CPU path the
golden parity against a merged release checks), whatever path the served forwards take.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from clef_worker.model.lora import SEGMENTS
from clef_worker.serving.policy import PADDED
from clef_worker.serving.runner import ModelRunner


def probe_slots(runner: ModelRunner, count: int) -> list[int]:
    """The variant slot of each of `count` probe requests, in probe order: the base (0) and
    each loaded variant in turn; all the base's without variants."""
    models = len(runner.heads)
    return [position % models for position in range(count)]


@contextmanager
def reference_runner(runner: ModelRunner) -> Iterator[ModelRunner]:
    """The plain eager runner (one request, no graphs, no packing, no prefix cache) over the
    served runner's backbone, heads, variants and vision tower, with the adapters applied as
    segments while it is in use."""
    plain = ModelRunner(runner.backbone, runner.head, runner.pad_id, layout=PADDED,
                        vision=runner.vision, variant_heads=runner.heads[1:],
                        selection=runner.selection)
    selection = runner.selection
    if selection is None:
        yield plain
        return
    mode, selection.mode = selection.mode, SEGMENTS
    try:
        yield plain
    finally:
        selection.mode = mode
