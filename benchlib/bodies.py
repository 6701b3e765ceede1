"""Varied Clef request bodies for the benchmarks that batch (a worker alone, and its CPU
profile), so both measure the same requests."""

from __future__ import annotations

import json
from typing import Any

QUESTIONS: dict[str, dict[str, Any]] = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "topic": {"type": "choice", "criteria": {"billing": "payments", "delivery": "shipping",
                                             "other": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}


def request_bodies(count: int, questions: int = 3) -> list[bytes]:
    """Varied requests with different states: with the three question types (the
    typical short request, ~400-480 tokens on the tiny fixture), or with the first `questions`."""
    bodies = []
    for i in range(count):
        body = {
            "model": "clef-flash",
            "state": f"Ticket {5000 + i}: customer paid invoice #{4400 + i} twice; " * (1 + i % 4),
            "questions": dict(list(QUESTIONS.items())[:questions]),
        }
        bodies.append(json.dumps(body).encode())
    return bodies


def mixed_length_bodies(count: int, longest: int = 1500) -> list[bytes]:
    """Distinct requests whose encoded lengths spread evenly from the shortest a request can be
    on the tiny fixture (about 130 tokens: the prompt template and one bare noul question take
    126) to about `longest` tokens, in a fixed order that puts far-apart lengths next to each
    other, so every batch mixes short and long requests the way Clef traffic does (a few
    questions at 260-480 tokens, many at 1.5-7k)."""
    sentence_tokens = 27  # one "Ticket N-k: ..." sentence on the tiny fixture's tokenizer
    fixed = 126
    steps = max(0, longest - fixed) // sentence_tokens
    bodies = []
    for i in range(count):
        rank = (i * 37) % count  # a fixed permutation of the lengths
        sentences = rank * steps // max(1, count - 1)
        bodies.append(_ticket_body(_ticket_state(7000 + i, sentences) or f"T{i}."))
    return bodies


def uniform_length_bodies(count: int, tokens: int = 500) -> list[bytes]:
    """Distinct requests of one encoded length (about `tokens` on the tiny fixture): the same
    number of sentences, each request's own ticket number (four digits for every request, so
    every state tokenizes to the same count). The mix where padding wastes nothing."""
    sentences = max(0, tokens - 126) // 27  # as mixed_length_bodies: 126 fixed, 27 a sentence
    return [_ticket_body(_ticket_state(7000 + i, sentences) or f"T{7000 + i}.")
            for i in range(count)]


def _ticket_state(ticket: int, sentences: int) -> str:
    """`sentences` sentences about one ticket (27 tokens each on the tiny fixture)."""
    return "".join(f"Ticket {ticket}-{k}: customer paid invoice #{k} twice. "
                   for k in range(sentences))


def _ticket_body(state: str) -> bytes:
    """A request with this state and one bare noul question."""
    return json.dumps({"model": "clef-flash", "state": state,
                       "questions": {"refund": {"type": "noul",
                                                "criteria": {"true": None, "false": None}}}}
                      ).encode()
