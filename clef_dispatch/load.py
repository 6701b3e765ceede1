"""How much work a replica holds, in tokens: the honest "utilisation" an endpoint picker reads.

The inference gateway's endpoint picker (docs/operations.md, "Behind the inference gateway")
routes each request by three gauges per pod: requests queued, requests running, and a 0-1
utilisation it treats as a KV cache's fill. Clef has no KV cache; what fills up is the worker's
token budget (`max_batch_tokens` in each worker's `ready`: the tokens one forward holds). So
utilisation here is the tokens of every request the replica holds (waiting in the front, or
sent to a worker and not answered) over the budgets of its ready workers, capped at 1: at 1 the
replica already holds at least one full forward per worker, and a new request waits behind it.

A request's token cost is known exactly only by the worker, which tokenises it (its reply
carries `input_tokens` and `truncated_tokens`); the front never tokenises (no tokenizer, no
work on the event loop). So the front estimates a request's tokens from its body length when
it is admitted: body bytes times a tokens-per-byte ratio, at most `--max-length` (the worker
cuts the state to fit), at least 1. The ratio starts at 1/4 (about four bytes of JSON per
token for English text) and learns from every answer: an exponentially weighted mean of the
answered requests' (input + truncated tokens) / body bytes, one answer weighing 1/32. Bodies
whose bytes are mostly not text (base64 images and videos) pull the ratio down while they are
frequent; the `--max-length` cap bounds any one request's estimate either way.

Everything here is plain integers and floats read without a lock: the counts are updated on
the event loop and read at scrape time, possibly from the metrics port's thread, where reading
an int is atomic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from clef_protocol.messages import ReadyInfo

# The starting tokens-per-byte ratio, before any answer taught a better one.
PRIOR_TOKENS_PER_BYTE = 0.25
# How much one answer moves the ratio (an exponentially weighted mean over ~32 answers).
LEARNING_WEIGHT = 1.0 / 32.0
# Bounds on the learned ratio: one odd answer (an empty-state request, a huge image) cannot
# drive the estimate to nothing or past one token per byte of body.
MIN_TOKENS_PER_BYTE = 1.0 / 64.0
MAX_TOKENS_PER_BYTE = 1.0


class TokenEstimate:
    """A request's token cost from its body length, learned from the workers' answers."""

    def __init__(self, max_length: int, tokens_per_byte: float = PRIOR_TOKENS_PER_BYTE) -> None:
        self._max_length = max_length
        self.tokens_per_byte = tokens_per_byte

    def cost(self, body_bytes: int) -> int:
        """The tokens a body of `body_bytes` is expected to cost: 1 .. `--max-length`."""
        return max(1, min(self._max_length, math.ceil(body_bytes * self.tokens_per_byte)))

    def learn(self, body_bytes: int, tokens: int) -> None:
        """A worker answered a body of `body_bytes` with `tokens` (input plus truncated)."""
        if body_bytes <= 0 or tokens <= 0:
            return
        ratio = min(MAX_TOKENS_PER_BYTE, max(MIN_TOKENS_PER_BYTE, tokens / body_bytes))
        self.tokens_per_byte += LEARNING_WEIGHT * (ratio - self.tokens_per_byte)


def token_budget(ready: Iterable[ReadyInfo], max_length: int) -> int:
    """The tokens the ready workers hold in one forward each, as each reported it in `ready`
    (the worker resolved its batch policy once, clef_worker.serving.policy); a worker that reports
    none
    counts one request of `max_length` (ReadyInfo.tokens_per_forward)."""
    return sum(info.tokens_per_forward(max_length) for info in ready)


def utilisation(outstanding_tokens: int, budget: int) -> float:
    """Tokens held over the budget, capped at 1; 1 when no worker is ready (no budget), so a
    picker that reads the gauge sends nothing to a replica that cannot serve."""
    if budget <= 0:
        return 1.0
    return min(1.0, outstanding_tokens / budget)


def utilisation_gauge(outstanding_tokens: Callable[[], int],
                      ready: Callable[[], Iterable[ReadyInfo]],
                      max_length: int) -> Callable[[], float]:
    """The gauge's read function, wired by the server from the dispatcher's state."""
    def read() -> float:
        return utilisation(outstanding_tokens(), token_budget(ready(), max_length))
    return read
