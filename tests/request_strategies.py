"""Hypothesis strategies for valid `/v1/systemone` requests (bucket and batching tests)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                max_size=40)
_WORDS = st.lists(st.sampled_from(["invoice", "refund", "late", "box", "card", "payé", "42",
                                   "urgent", "ok", "<|endoftext|>", "\n", "ticket"]),
                  max_size=120).map(" ".join)


def _question() -> st.SearchStrategy[dict[str, Any]]:
    noul = st.fixed_dictionaries({"type": st.just("noul")},
                                 optional={"instructions": _TEXT})
    choice = st.fixed_dictionaries({
        "type": st.just("choice"),
        "criteria": st.dictionaries(st.text(min_size=1, max_size=8), st.none() | _TEXT,
                                    min_size=1, max_size=5),
    }, optional={"instructions": _TEXT})
    score = st.fixed_dictionaries({
        "type": st.just("score"),
        "criteria": st.lists(_TEXT, min_size=1, max_size=5),
    }, optional={"instructions": _TEXT})
    return st.one_of(noul, choice, score)


def requests() -> st.SearchStrategy[dict[str, Any]]:
    """Valid requests: a state of words or any JSON-ish text, 1 to 4 questions of every type."""
    return st.fixed_dictionaries({
        "model": st.just("clef-flash"),
        "state": _WORDS | _TEXT | st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
        "questions": st.dictionaries(st.text(alphabet="abcdefghij", min_size=1, max_size=6),
                                     _question(), min_size=1, max_size=4),
    })
