"""What the GPU sitting sends: requests whose states are distinct, and hits on a cached prefix.

Why: a benchmark that repeats one body measures the caches, not the model. With the answer cache
off, a repeated body still hits the prefix cache (a state of 256 tokens or more stores points),
so the first H200 sitting's "latency at 7,000 tokens" was a prefix hit, and its states were one
phrase repeated. Here every request's state is realistic event text (`StateWriter`, the prefix
benchmark's) that begins with its own case number, so no request shares a cached block with any
other (the prompt before the state is shorter than one cache block, and a block's key covers
everything before it): each one is a fresh forward that also stores its points, as a user's
first request does. The text after the case number comes from a few templates per length, built
once, so making a body costs microseconds and a closed-loop load can draw a new one per request.

`HitBodies` is the other side: one long state stored once, then requests that reuse it and add
their own new tokens (an agent's next turn, a fan-out's next question over a long document).

Server-Timing says what the worker reused (`prefix;desc="reused=N"`), so each phase can prove
that its fresh requests reused nothing and its hits reused the prefix (`timing_of`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

from benchlib.prefix_workloads import StateWriter

WORKER_MS = re.compile(r"(?:^|,\s*)worker;dur=([0-9.]+)")
REUSED = re.compile(r'prefix;desc="reused=(\d+)"')
# A state this long stores points in the prefix cache (the store path users' first requests
# take); the targets' fresh-state figures are for such states.
MIN_STATE_TOKENS = 256
TEMPLATES = 4  # template texts per length: bodies differ beyond their first words too


def timing_of(header: str | None) -> tuple[float | None, int]:
    """The worker's milliseconds (None: not reported) and the tokens it reused (0: none said)
    from one answer's Server-Timing header."""
    text = header or ""
    worker = WORKER_MS.search(text)
    reused = REUSED.search(text)
    return (float(worker[1]) if worker else None), (int(reused[1]) if reused else 0)


def request_body(state: str, questions: dict[str, Any]) -> bytes:
    return json.dumps({"model": "bench", "state": state, "questions": questions}).encode()


class DistinctStates:
    """Bodies of about a given encoded length, each with a state no other body shares a prefix
    with. `count_tokens(request)` is the request's encoded length (the server's encoder)."""

    def __init__(self, tokenizer: Any, count_tokens: Callable[[dict[str, Any]], int],
                 questions: dict[str, Any], min_state: int = MIN_STATE_TOKENS) -> None:
        self._tokenizer = tokenizer
        self._count = count_tokens
        self.questions = questions
        self.min_state = min_state
        self._numbers = itertools.count()
        self._templates: dict[int, list[str]] = {}
        self.base_tokens = count_tokens({"model": "bench", "state": "", "questions": questions})

    def state_tokens(self, tokens: int) -> int:
        """The state's share of a request of `tokens` tokens (never below `min_state`)."""
        return max(self.min_state, tokens - self.base_tokens)

    def _template(self, tokens: int, index: int) -> str:
        if tokens not in self._templates:
            self._templates[tokens] = [self._fit(tokens, k) for k in range(TEMPLATES)]
        return self._templates[tokens][index % TEMPLATES]

    def _fit(self, tokens: int, seed: int) -> str:
        """Event text for a request of about `tokens` tokens: grown past the state's share,
        then cut word by word until the request (with a case number in front) fits, its
        state still at least `min_state` tokens."""
        words = StateWriter(self._tokenizer, seed=1000 * tokens + seed,
                            topic=f"Ticket log {seed}").grow_to(
                                self.state_tokens(tokens)).split(" ")
        while len(words) > 1:
            shorter = " ".join(words[:-1])
            state = f"Case {0:07d}. {shorter}"
            state_tokens = len(self._tokenizer.encode(state, add_special_tokens=False).ids)
            total = self._count({"model": "bench", "state": state, "questions": self.questions})
            if total < tokens or state_tokens < self.min_state:
                break
            words.pop()
        return " ".join(words)

    def prepare(self, lengths: list[int]) -> None:
        """Build the templates of these lengths now (seconds at 7,000 tokens: done while the
        server starts, not inside a timed phase)."""
        for tokens in lengths:
            self._template(tokens, 0)

    def state(self, tokens: int) -> str:
        """A state never returned before, for a request of about `tokens` tokens."""
        number = next(self._numbers)
        return f"Case {number:07d}. {self._template(tokens, number)}"

    def body(self, tokens: int) -> bytes:
        return request_body(self.state(tokens), self.questions)

    def encoded_tokens(self, body: bytes) -> int:
        return self._count(json.loads(body))


class HitBodies:
    """A `prefix_tokens` state stored once (`store_body`), then requests that keep it and add
    about `new_tokens` tokens of their own (`next_body`): each reuses the cached prefix."""

    def __init__(self, tokenizer: Any, questions: dict[str, Any], prefix_tokens: int,
                 new_tokens: int) -> None:
        self.questions = questions
        self.prefix = StateWriter(tokenizer, seed=7, topic="Agent session 6600").grow_to(
            prefix_tokens)
        self._continuation = StateWriter(tokenizer, seed=8, topic="Next turn").grow_to(
            new_tokens)
        self._numbers = itertools.count()

    def store_body(self) -> bytes:
        return request_body(self.prefix, self.questions)

    def next_body(self) -> bytes:
        """The prefix and a continuation never sent before (its own turn number first)."""
        return request_body(f"{self.prefix} Turn {next(self._numbers):05d}: "
                            f"{self._continuation}", self.questions)


def bucket_replay_ms(replays: dict[str, float], tokens: int) -> tuple[str, float] | None:
    """The replay time of the smallest one-sequence graph shape that holds `tokens` tokens,
    from the worker's warm-up table (`{"(8192,)": ms}` for packed total-token shapes, or
    `{"(1, 8192)": ms}` for padded rows x length); None when no shape holds it."""
    best: tuple[int, str, float] | None = None
    for shape, ms in replays.items():
        numbers = [int(n) for n in re.findall(r"\d+", shape)]
        if not numbers or (len(numbers) > 1 and numbers[0] != 1):
            continue
        size = numbers[-1]
        if size >= tokens and (best is None or size < best[0]):
            best = (size, shape, ms)
    return None if best is None else (best[1], best[2])


REPLAY_LINE = re.compile(r"replayed \d+ shapes once; replay ms: (\{.*\})")


def replay_table(log: str) -> dict[str, float]:
    """The first worker's warm-up replay times (its `replayed N shapes once` log line)."""
    import ast

    match = REPLAY_LINE.search(log)
    if match is None:
        return {}
    try:
        table = ast.literal_eval(match[1])
    except (ValueError, SyntaxError):
        return {}
    return {str(k): float(v) for k, v in table.items()} if isinstance(table, dict) else {}
