"""The executor interface: what the worker loop needs from a model implementation.

The loop (clef_worker.main) knows nothing about Clef: it loads an executor, warms it up, then
feeds it request bodies. Swapping the native executor for the release's own code, or a test
double, changes nothing else in the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from clef_protocol.messages import ModelInfo, PrefixStats
from clef_worker.serving.policy import BatchPolicy


@dataclass(frozen=True)
class Answer:
    """One answered request: the final response bytes and what encoding it cost.

    `input_tokens` (the encoded sequence's length) and `truncated_tokens` (state tokens dropped
    to fit `--max-length`) travel to the front in the `response` frame, for token counters and
    the `X-Clef-State-Truncated` header. An executor that cannot tell leaves them 0.

    `batch_size` is how many requests the forward that produced this answer held, and `stages`
    that forward's own times (`forward_ms`, `head_ms`): both describe what actually ran, so a
    request the runner answered alone says 1 even when it arrived with others. An executor that
    does not time its stages leaves `stages` empty.

    `prefix` is the prefix cache's part (the tokens this request reused, the worker's cache
    figures); None from an executor without a prefix cache.

    `model` names the fine-tuned variant that scored it ("" for the base model): the serve loop
    puts that model's fingerprint in the `response` frame (`weights`), so the front can bind the
    answer to the weights that made it.
    """

    body: bytes
    input_tokens: int = 0
    truncated_tokens: int = 0
    batch_size: int = 1
    stages: dict[str, float] = field(default_factory=dict)
    prefix: PrefixStats | None = None
    model: str = ""


class Executor(Protocol):
    """A loaded model that answers `/v1/systemone` bodies, one at a time, on the calling thread."""

    def describe(self) -> ModelInfo:
        """Identify the model and how it runs."""
        ...

    def warm_up(self) -> None:
        """Run representative forwards so the first real request pays no first-touch cost."""
        ...

    def answer(self, body: bytes) -> Answer:
        """Answer one raw request body with the final response JSON bytes and token counts.

        Raise `clef_protocol.errors.RequestInvalid` for a request the model must refuse (the
        worker answers 422 with its message), `ExecutorBroken` when the executor cannot go on;
        any other exception becomes a 500 and the worker keeps serving.
        """
        ...


class LoadedExecutor(Executor, Protocol):
    """An executor as the worker's loader returns it: with the batch policy resolved from the
    worker's flags when it was loaded (the one place it is resolved), which the serve loop
    groups by and `ready` reports. Tests' fakes are plain `Executor`s and get the defaults."""

    policy: BatchPolicy
