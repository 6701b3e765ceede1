"""Encoding a `/v1/systemone` request into the token sequence the model was trained on (spec §3).

The prompt is built from *pieces*, each tokenized on its own (`add_special_tokens=False`) and
concatenated: tokenizing the whole prompt at once would merge tokens across piece boundaries and
move the spans the head reads. Fixed pieces (prefix, headers, suffix, `OPTION {j}: `...) are
tokenized once and cached; the variable ones of a request go through one `encode_batch` call, so
the Python work per request is proportional to the number of pieces, never to the number of
tokens.

The request is assumed to have passed `clef_protocol.validation.validate_request`; the only
refusal made here is the token budget (reference check 4), which needs the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from clef_protocol.errors import RequestInvalid

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
PREFIX = (
    "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
)
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER = "\nALLOWED OPTIONS:\n"
OPTION_END = "\n"
FIELD_END = "END FIELD\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"

# The head's type id of each question type: the row of its `type_embedding` the release was
# trained with. A model fact: the protocol only says which names a request may use.
TYPE_IDS: dict[str, int] = {"noul": 0, "choice": 1, "score": 2}
# The reference's refusal when the schema leaves no room for the state (check 4).
BUDGET = "schema requires {fixed} tokens before state; maximum is {maximum}"
NOUL_DEFAULTS: tuple[tuple[str, str], ...] = (
    ("true", "The proposition is true or the answer is yes."),
    ("false", "The proposition is false or the answer is no."),
)


def render(value: Any) -> str:
    """A string as is; any other JSON value as compact, key-sorted JSON (the training format)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def encode_order(question: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """A question's `(option id, description)` pairs in the order they appear in the prompt.

    noul: always `true`, `false`; a criteria object overrides either description (a null one
    drops it). choice: sorted by option id. score: level index in array order.
    """
    kind = question["type"]
    criteria: Any = question.get("criteria")
    if kind == "noul":
        overrides = criteria if isinstance(criteria, Mapping) else {}
        return [
            (option, overrides.get(option, default))
            for option, default in NOUL_DEFAULTS
        ]
    if kind == "choice":
        return sorted(((str(key), value) for key, value in criteria.items()), key=_first)
    if kind == "score":
        return [(str(index), value) for index, value in enumerate(criteria)]
    raise ValueError(f"unknown question type {kind!r}")  # validate_request prevents this


def _first(pair: tuple[str, Any]) -> str:
    return pair[0]


def option_semantics(option_id: str, description: Any) -> str:
    """The text of one option's span: `{"description": d, "option_id": id}`, sorted keys."""
    semantics: dict[str, Any] = {"option_id": option_id}
    if description is not None:
        semantics["description"] = description
    return render(semantics)


@dataclass(frozen=True)
class EncodedQuestion:
    """Where one question sits in the sequence; spans are half-open `[start, end)` positions."""

    id: str
    type: str
    type_id: int
    question_span: tuple[int, int]
    option_ids: tuple[str, ...]
    option_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Encoding:
    """The token sequence of one request and the positions the head reads."""

    input_ids: list[int]
    questions: tuple[EncodedQuestion, ...]
    state_tokens: int
    truncated_tokens: int = 0  # state tokens cut to fit the budget

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def state_truncated(self) -> bool:
        return self.truncated_tokens > 0


# Pieces of a schema: a tuple of cached ids, or the index of a text in the batch to encode.
_Segment = tuple[int, ...] | int


class Encoder:
    """Turns validated requests into `Encoding`s with one tokenizer, caching the fixed pieces.

    `state_window` bounds how much of a very long state is tokenized: only a prefix of
    `state_window * budget` characters (growing if needed) is encoded, and only the tokens that
    cannot depend on the cut are kept (see `_state_ids`), so the ids of an 8 MiB state cost what
    its first few thousand tokens cost. Counting the tokens dropped still passes over the whole
    text once, on the tokenizer's fast path (`_token_count`).
    """

    def __init__(self, tokenizer: Tokenizer, *, state_window: int = 8, state_slack: int = 4096):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._state_window = state_window
        self._state_slack = state_slack
        self._longest_added_token = max(
            (len(token.content) for token in tokenizer.get_added_tokens_decoder().values()),
            default=0,
        )
        self.prefix_ids = self._ids(PREFIX)
        self.schema_header_ids = self._ids(SCHEMA_HEADER)
        self.suffix_ids = self._ids(SUFFIX)
        self._options_header = self._ids(OPTIONS_HEADER)
        self._option_end = self._ids(OPTION_END)
        self._field_end = self._ids(FIELD_END)
        self._option_label = lru_cache(maxsize=4096)(self._option_label_uncached)

    @classmethod
    def from_file(cls, path: Path | str, **kwargs: Any) -> Encoder:
        """Load `tokenizer.json` with the `tokenizers` library (no transformers tokenizer)."""
        return cls(Tokenizer.from_file(str(path)), **kwargs)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def fixed_overhead(self) -> int:
        """Tokens every request spends on prefix, schema header and suffix."""
        return len(self.prefix_ids) + len(self.schema_header_ids) + len(self.suffix_ids)

    def _ids(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _option_label_uncached(self, number: int) -> tuple[int, ...]:
        return self._ids(f"OPTION {number}: ")

    def encode(
        self,
        request: Mapping[str, Any],
        max_length: int,
        media_ids: Sequence[int] = (),
    ) -> Encoding:
        """Encode a validated request; raise `RequestInvalid` if its schema exceeds the budget.

        `media_ids` are the request's media tokens (clef_worker.media.vision): they go between the
        prefix and the state and count against the budget like the schema.
        """
        segments: list[_Segment] = [self.schema_header_ids]
        texts: list[str] = []
        # Per question: (id, type, header-of-span segment index, option ids, option segment idx)
        layout: list[tuple[str, str, int, list[str], list[int]]] = []

        def text_segment(text: str) -> int:
            texts.append(text)
            segments.append(len(texts) - 1)
            return len(segments) - 1

        for number, (question_id, question) in enumerate(request["questions"].items(), 1):
            kind = question["type"]
            text_segment(f"\nFIELD {number}\nID: {question_id}\nTYPE: {kind}\nINSTRUCTION: ")
            span_segment = text_segment(render(question.get("instructions") or question_id))
            segments.append(self._options_header)
            option_ids: list[str] = []
            option_segments: list[int] = []
            for option_number, (option_id, description) in enumerate(encode_order(question), 1):
                segments.append(self._option_label(option_number))
                option_segments.append(text_segment(option_semantics(option_id, description)))
                segments.append(self._option_end)
                option_ids.append(option_id)
            segments.append(self._field_end)
            layout.append((question_id, kind, span_segment, option_ids, option_segments))

        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        pieces: list[Sequence[int]] = [
            segment if isinstance(segment, tuple) else encoded[segment].ids
            for segment in segments
        ]
        starts = [0] * (len(pieces) + 1)
        for index, piece in enumerate(pieces):
            starts[index + 1] = starts[index] + len(piece)
        schema_length = starts[-1]

        fixed = len(self.prefix_ids) + len(media_ids) + schema_length + len(self.suffix_ids)
        if fixed > max_length:
            raise RequestInvalid(BUDGET.format(fixed=fixed, maximum=max_length))
        state_ids, dropped = self._state_ids(render(request["state"]), max_length - fixed)
        offset = len(self.prefix_ids) + len(media_ids) + len(state_ids)

        def span(segment_index: int) -> tuple[int, int]:
            return (offset + starts[segment_index], offset + starts[segment_index + 1])

        for question_id, _, span_segment, _, _ in layout:
            if starts[span_segment] == starts[span_segment + 1]:
                # The head averages over this span; an empty one would make the answer NaN.
                raise RequestInvalid(f"{question_id}: the instruction encodes to no tokens")

        questions = tuple(
            EncodedQuestion(
                id=question_id,
                type=kind,
                type_id=TYPE_IDS[kind],
                question_span=span(span_segment),
                option_ids=tuple(option_ids),
                option_spans=tuple(span(index) for index in option_segments),
            )
            for question_id, kind, span_segment, option_ids, option_segments in layout
        )
        input_ids = list(
            chain(self.prefix_ids, media_ids, state_ids, chain.from_iterable(pieces),
                  self.suffix_ids)
        )
        return Encoding(
            input_ids=input_ids,
            questions=questions,
            state_tokens=len(state_ids),
            truncated_tokens=dropped,
        )

    def _state_ids(self, text: str, budget: int) -> tuple[list[int], int]:
        """The first `budget` tokens of the state, and how many tokens were cut.

        A long state is tokenized through a growing character window instead of whole. Tokens
        are only kept from pre-tokens ("words") that cannot depend on the cut: BPE works inside a
        pre-token, and the pre-tokenizer's regex decides a pre-token's extent from at most the
        next two pre-tokens (a whitespace run splits into at most three), so dropping every
        token of the last four words that end before the window's last possible added token
        leaves exactly what the whole text would give.
        `tests/test_encoding.py` checks this against whole-text encoding.
        """
        window = max(self._state_window * budget + self._state_slack, 1)
        while window < len(text):
            encoding = self._tokenizer.encode(text[:window], add_special_tokens=False)
            words = encoding.word_ids
            # Only tokens that end before `settled` are counted: an added token (`<|im_end|>`)
            # cut by the window splits into several ordinary words, but one that starts before
            # `settled` ends inside the window, so the text before it is matched as in the
            # whole text.
            settled = window - self._longest_added_token
            last = next((word for word, (_, end) in zip(reversed(words),
                                                        reversed(encoding.offsets), strict=True)
                         if word is not None and end <= settled), None)
            if last is not None:
                keep = len(words)
                while keep and ((word := words[keep - 1]) is None or word > last - 4):
                    keep -= 1
                if keep >= budget:
                    return encoding.ids[:budget], self._token_count(text) - budget
            window *= 4
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids[:budget], max(len(ids) - budget, 0)

    def _token_count(self, text: str) -> int:
        """How many tokens the whole text encodes to (for the count of dropped tokens only).

        Only a cut state pays for this: one pass of the tokenizer's fast path (no offsets) over
        the whole text, about a third of a full encode. Exact, because the count is reported to
        the client (`X-Clef-State-Truncated`).
        """
        return len(self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0])
