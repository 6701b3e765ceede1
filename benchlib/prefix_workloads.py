"""The prefix cache's three workloads, as request bodies, and how two answers are compared.

Shared by `bench/bench_prefix_cache.py` (the figures in docs/benchmarks.md) and the end-to-end
test (tests/test_prefix_cache_http.py, smaller sizes), so both run the same shapes:

- (a) `agent_loop`: one state that grows by about `step` tokens a turn, a request with three
  questions at every turn (an agent asking its decisions about what has happened so far);
- (b) `fan_out`: one long state asked several different question sets (a pipeline reading one
  document);
- (c) `unrelated`: requests whose states share nothing (what the cache must not slow down).

Sizes are in state tokens, counted with the snapshot's own tokenizer (`tokenizer.json`), so
"~2,400 tokens" means it on the model served. Each event is a sentence that begins with a space
and ends with a full stop: the text a turn appends never merges with the last token of the
state before it, so a grown state's ids begin with the previous state's ids (as with real logs,
whose lines end with a newline).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchlib.bodies import QUESTIONS

# Every answer of the prefix cache must equal the uncached forward's within this (the golden
# bound; answers are rounded to 4 decimals, so one unit of rounding is inside it).
ANSWER_TOLERANCE = 1.5e-4

_SUBJECTS = ("the agent", "the customer", "the courier", "the billing system", "support",
             "the warehouse", "the fraud check", "the mobile app")
_VERBS = ("opened", "closed", "escalated", "refunded", "flagged", "updated", "reassigned",
          "delayed", "confirmed", "rejected")
_OBJECTS = ("order", "invoice", "ticket", "parcel", "payment", "account", "return", "claim")


@dataclass(frozen=True)
class Workload:
    """One workload: its name and its requests in the order sent (one at a time). `turns`
    groups them: a turn's requests are the ones timed together (the first turn is the cold
    one)."""

    name: str
    turns: list[list[bytes]]

    @property
    def requests(self) -> list[bytes]:
        return [body for turn in self.turns for body in turn]


class StateWriter:
    """Event sentences appended to a state, with the state's token count kept."""

    def __init__(self, tokenizer: Tokenizer, seed: int, topic: str) -> None:
        self._tokenizer = tokenizer
        self._random = random.Random(seed)
        self._topic = topic
        self._events = 0
        self.text = f"{topic}."
        self.tokens = self._count(self.text)

    def _count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def grow_to(self, tokens: int) -> str:
        """Append events until the state holds at least `tokens` tokens; the new state."""
        while self.tokens < tokens:
            self._events += 1
            pick = self._random.choice
            sentence = (f" Event {self._events} of {self._topic}: {pick(_SUBJECTS)} "
                        f"{pick(_VERBS)} {pick(_OBJECTS)} #{self._random.randrange(10**5)} "
                        f"after {self._random.randrange(2, 90)} minutes.")
            self.text += sentence
            self.tokens = self._count(self.text)
        return self.text


def tokenizer_of(snapshot: Path) -> Tokenizer:
    return Tokenizer.from_file(str(snapshot / "tokenizer.json"))


def _body(state: str, questions: dict[str, Any]) -> bytes:
    return json.dumps({"model": "clef-flash", "state": state, "questions": questions}).encode()


def question_set(index: int) -> dict[str, Any]:
    """The `index`-th of several different question sets about one state (ids, instructions
    and options all differ from one set to the next)."""
    return {
        f"refund_{index}": {"type": "noul",
                            "instructions": f"Reading check {index}: was a refund promised?"},
        f"team_{index}": {"type": "choice", "criteria": {
            f"billing_{index}": "payments and invoices", f"logistics_{index}": "shipping",
            "other": None}},
        f"risk_{index}": {"type": "score", "criteria": ["none", "low", "high", f"level {index}"]},
    }


def agent_loop(tokenizer: Tokenizer, start: int, end: int, step: int,
               seed: int = 1) -> Workload:
    """(a): a state from `start` to `end` tokens, `step` more each turn, one request with three
    questions per turn."""
    writer = StateWriter(tokenizer, seed, "Agent session 4711")
    turns = []
    target = start
    while target <= end:
        turns.append([_body(writer.grow_to(target), dict(QUESTIONS))])
        target += step
    return Workload("agent_loop", turns)


def fan_out(tokenizer: Tokenizer, tokens: int, sets: int, seed: int = 2) -> Workload:
    """(b): one state of `tokens` tokens asked `sets` different question sets."""
    state = StateWriter(tokenizer, seed, "Contract review 88").grow_to(tokens)
    return Workload("fan_out", [[_body(state, question_set(i))] for i in range(sets)])


def unrelated(tokenizer: Tokenizer, count: int, tokens: int, seed: int = 3) -> Workload:
    """(c): `count` requests of about `tokens` state tokens each, sharing nothing: each state
    begins with its own words (not a common header), each with its own question set."""
    turns = []
    for i in range(count):
        topic = f"{i * 7919 % 10007} unrelated case {i}"
        state = StateWriter(tokenizer, seed + i, topic).grow_to(tokens)
        turns.append([_body(state, question_set(100 + i))])
    return Workload("unrelated", turns)


def max_difference(got: bytes, want: bytes) -> float:
    """The largest difference between two answers' numbers; infinity when anything else
    differs (a key, a label, an option order)."""
    try:
        return max(_differences(json.loads(got), json.loads(want)), default=0.0)
    except _Mismatch:
        return math.inf


class _Mismatch(Exception):
    pass


def _differences(a: Any, b: Any) -> Iterator[float]:
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            raise _Mismatch
        for key in a:
            yield from _differences(a[key], b[key])
    elif isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            raise _Mismatch
        for x, y in zip(a, b, strict=True):
            yield from _differences(x, y)
    elif isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            raise _Mismatch
        yield abs(float(a) - float(b))
    elif a != b:
        raise _Mismatch
