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
