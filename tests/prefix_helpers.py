"""Helpers of the prefix-cache test modules (tests/test_prefix_cache.py,
tests/test_prefix_graphed.py): a state of numbered events, and a request's uncached answer."""

from __future__ import annotations

import json
from typing import Any

from clef_worker.native import NativeExecutor, Prepared
from clef_worker.serving.executor import Answer
from clef_worker.starting.variant_probe import reference_runner


def events(count: int, tag: str = "") -> dict[str, Any]:
    """A JSON state of `count` distinct events (`tag` makes two such states differ)."""
    return {"events": [{"n": i, "note": f"{tag}invoice {i * 37} paid by {i % 11}"}
                       for i in range(count)]}


def uncached_probabilities(executor: NativeExecutor, prepared: Prepared) -> list[float]:
    """The uncached answer: the plain eager forward of the request alone (no prefix cache)."""
    with reference_runner(executor.runner) as plain:
        assert plain.prefix_cache is None
        return plain.run([prepared.encoding], slots=[prepared.slot]).rows[0].probabilities


def request_body(state: Any, questions: dict[str, Any], model: str = "clef-flash") -> bytes:
    return json.dumps({"model": model, "state": state, "questions": questions}).encode()


def agent_loop(executor: NativeExecutor, questions: dict[str, Any], bound: float,
               turns: int = 3) -> tuple[list[int], Answer]:
    """A state growing turn by turn through the cache (emptied first): each turn's answer to
    the first question must be the uncached one within `bound`; the tokens each turn reused
    and the last answer come back for the caller's own checks."""
    cache = executor.runner.prefix_cache
    assert cache is not None
    cache.clear()
    first = next(iter(questions))
    reused: list[int] = []
    answer: Answer | None = None
    for turn in range(turns):
        prepared = executor.prepare(request_body(events(14 + 4 * turn), questions))
        [answer] = executor.answer_prepared([prepared])
        assert answer.prefix is not None
        reused.append(answer.prefix.reused_tokens)
        got = list(json.loads(answer.body)["answers"][first]["probabilities"].values())
        want = uncached_probabilities(executor, prepared)
        assert max(abs(p - w) for p, w in zip(got, want, strict=True)) <= bound
    assert answer is not None
    return reused, answer
