"""What the start-up runs: the executor it warms and checks (`WarmTarget`), and the warm-up
requests derived from the limits the worker serves under (`candidates`, `choose`,
`with_image`, `synthetic_encoding`). Why derived: a fixed warm-up request can need more tokens
(or questions, options, levels) than `--max-length` and the other limits allow, and the worker
then refused to start although every request it would refuse is just a 422. So the warm-up is
the richest of a few candidate requests that the worker itself would accept under its limits,
trimmed to them; when none fits (a `--max-length` below any schema's fixed tokens), the caller
warms what it can without a request. Both executors, the self-check and its prefix probe take
their requests from here, so there is one warm-up request; this module sits below all of them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from itertools import cycle, islice
from typing import TYPE_CHECKING, Any, Protocol

from clef_protocol.errors import RequestInvalid
from clef_protocol.media import gradient_image, png_data_uri
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import TYPE_IDS, EncodedQuestion, Encoding

if TYPE_CHECKING:
    import torch

    from clef_protocol.messages import ModelInfo
    from clef_worker.media.vision import PreparedMedia, VisionTower
    from clef_worker.model.backbone import Backbone
    from clef_worker.model.encoding import Encoder
    from clef_worker.serving.policy import BatchPolicy
    from clef_worker.serving.prefix.cache import CacheKey
    from clef_worker.serving.runner import ModelRunner


class WarmTarget(Protocol):
    """What the warm-up needs of an executor (clef_worker.native.NativeExecutor has it); a
    protocol, so this module and the executor that calls it need not import each other."""

    limits: RequestLimits
    runner: ModelRunner
    policy: BatchPolicy
    encoder: Encoder
    graph_failure: str
    planned_shapes: list[list[int]]

    @property
    def backbone(self) -> Backbone: ...

    @property
    def vision(self) -> VisionTower | None: ...

    @property
    def device(self) -> torch.device: ...

    def encode(self, request: dict[str, Any]) -> Encoding: ...

    def score(self, request: dict[str, Any]) -> object: ...

    def describe(self) -> ModelInfo: ...

    def prefix_key(self, encoding: Encoding, media: PreparedMedia | None = None,
                   slot: int = 0) -> CacheKey | None:
        """The prefix-cache key the serve loop gives such a request (the self-check's `prefix`
        probe keys its requests with it)."""
        ...

# The richest candidate: ~250 tokens of state and the three question types, like a typical
# small request. The state is truncated to the budget by the encoder like any request's.
REPRESENTATIVE: dict[str, Any] = {
    "model": "warm-up",
    "state": (
        "Ticket 5521: the customer paid invoice #4411 ($12,400) twice by card on 2026-09-30; "
        "the second charge is still pending and the customer asks for a refund of the "
        "duplicate. Earlier messages mention a delayed delivery and a damaged box. "
    ) * 2,
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "topic": {
            "type": "choice",
            "instructions": "What is the ticket about?",
            "criteria": {
                "billing": "Payments, invoices and refunds",
                "delivery": "Shipping and delivery problems",
                "product": "Defects or questions about a product",
                "other": None,
            },
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is the ticket?",
            "criteria": ["none", "low", "medium", "high", "critical"],
        },
    },
}

# Smaller schemas, richest first: the three types bare, then each type alone with the fewest
# schema tokens it can have (a noul question whose option descriptions are dropped).
_BARE: dict[str, dict[str, Any]] = {
    "c": {"type": "choice", "criteria": {"a": None, "b": None}},
    "s": {"type": "score", "criteria": [None, None]},
    "n": {"type": "noul", "criteria": {"true": None, "false": None}},
}


def candidates(limits: RequestLimits) -> Iterator[dict[str, Any]]:
    """Candidate warm-up requests, richest first, each trimmed to the request-shape limits."""
    schemas = [REPRESENTATIVE["questions"], _BARE, *({qid: q} for qid, q in _BARE.items())]
    for questions in schemas:
        request = copy.deepcopy(REPRESENTATIVE)
        request["questions"] = _trimmed(questions, limits)
        yield request


def choose(limits: RequestLimits, encode: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
    """The first candidate that validates and that `encode` accepts (it raises RequestInvalid
    when the schema needs more tokens than `limits.max_length`); None when none fits."""
    for request in candidates(limits):
        try:
            validate_request(request, limits)
            encode(request)
        except RequestInvalid:
            continue
        return request
    return None


@functools.cache
def _image_uri() -> str:
    """The warm-up's picture as a data URI, encoded once (the warm-up and the self-check's
    prefix probe send it with every candidate they try)."""
    return png_data_uri(gradient_image(512, 512))


def with_image(request: dict[str, Any]) -> dict[str, Any]:
    """The request with one 512x512 PNG, the size clients send (warms the vision tower)."""
    return {**request, "images": [_image_uri()]}


def synthetic_encoding(filler: Sequence[int], length: int) -> Encoding | None:
    """A `length`-token sequence with one two-option noul question on its first three tokens.

    For a `--max-length` too short for any request: the backbone and head still run once on a
    sequence of the longest admissible length, so their first-touch costs are paid before
    `ready`. `filler` gives the token ids (cycled). None below 3 tokens (no room for a question
    and two options), where there is nothing worth warming.
    """
    if length < 3 or not filler:
        return None
    question = EncodedQuestion(
        id="warm-up", type="noul", type_id=TYPE_IDS["noul"], question_span=(0, 1),
        option_ids=("true", "false"), option_spans=((1, 2), (2, 3)),
    )
    ids = list(islice(cycle(filler), length))
    return Encoding(input_ids=ids, questions=(question,), state_tokens=0)


def _trimmed(questions: dict[str, Any], limits: RequestLimits) -> dict[str, Any]:
    """At most `max_questions` questions, `max_choice_options` options, `max_score_levels`."""
    kept: dict[str, Any] = {}
    for qid, question in islice(questions.items(), limits.max_questions):
        question = copy.deepcopy(question)
        criteria = question.get("criteria")
        if question["type"] == "choice":
            question["criteria"] = dict(islice(criteria.items(), limits.max_choice_options))
        elif question["type"] == "score":
            question["criteria"] = criteria[: limits.max_score_levels]
        kept[qid] = question
    return kept
