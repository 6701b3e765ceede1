"""Generated request bodies for `clef-bench --tokens T --questions Q`.

A load test needs requests of a known shape more than realistic text: the state is about `T`
words (a word is roughly one token with Clef's tokenizer; `/health` and the server's access log
show the real counts), and the questions cycle through the three types so every head path is
exercised. The same body is sent every time: the server keeps no cache, so repeating it costs
what a new one of that shape would.
"""

from __future__ import annotations

import json

_WORDS = ("invoice", "payment", "customer", "order", "shipment", "delayed", "refund", "account",
          "contract", "renewal", "support", "ticket", "priority", "billing", "address", "update")


def generated_body(tokens: int, questions: int, model: str = "clef-flash") -> bytes:
    """A valid request with a state of about `tokens` words and `questions` questions."""
    state = " ".join(f"{_WORDS[i % len(_WORDS)]}{i % 97}" if i % 7 == 6
                     else _WORDS[i % len(_WORDS)] for i in range(tokens))
    asked: dict[str, dict[str, object]] = {}
    for index in range(questions):
        kind = ("noul", "choice", "score")[index % 3]
        question: dict[str, object] = {"type": kind,
                                       "instructions": f"Question {index} about the state?"}
        if kind == "choice":
            question["criteria"] = {"yes": "clearly so", "no": "clearly not",
                                    "unclear": "the state does not say"}
        elif kind == "score":
            question["criteria"] = ["none", "some", "a lot"]
        asked[f"q{index}"] = question
    return json.dumps({"model": model, "state": state, "questions": asked}).encode()
