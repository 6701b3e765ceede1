"""The start-up self-check's requests: the `groups` and `small` probes' encodings, cut from the
warm-up's candidate schemas to the lengths the check wants (clef_worker.starting.self_check's
module docs say what each probe sends and why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import Encoding
from clef_worker.serving.gpu.packed_graphs import PackedGraphRunner, aligned_total

if TYPE_CHECKING:
    from clef_worker.starting.warm_requests import WarmTarget

# Fractions of the token room (`GROUP_ROOM`, the budget or --max-length if smaller) of the
# mixed group's requests, and of each of the uniform group's three: together within the
# budget, so each group is one forward where the budget allows it.
# Small shares: the check runs every request twice at start-up.
MIXED = (0.03, 0.2, 0.08, 0.12)
UNIFORM = 0.1
UNIFORM_COUNT = 3
# The mixed and uniform groups test mixing, not size (the largest-shape group tests size):
# their room is capped, so a 16,384-token budget does not make them ~12,000 tokens each way
# (at 2,048, mixed lengths of 125 to 409 tokens and uniform ones of 204: the cost estimate).
GROUP_ROOM = 2048
# The largest-shape group (graphs only): short requests of these shares of LARGEST_REAL real
# tokens (at most half the shape's tokens, so padding always follows them), forced into the
# largest built shape. Only their real tokens go through the eager reference.
LARGEST_REAL = 1000
LARGEST_MIX = (0.6, 0.25, 0.15)
# The small probe: the length most traffic has, and two pairs in the same bucket as it (each
# pair's requests aligned to 64 add up to 384, the bucket a lone 370-token request uses).
SMALL_LENGTH = 370
SAME_BUCKET_PAIRS = ((120, 240), (230, 110))


def largest_shape(target: WarmTarget) -> tuple[int, int] | None:
    """The largest built graph shape, `[rows, tokens]` as `graph_shapes` lists it: packed,
    the largest bucket (one row); padded, the longest bucket at the most rows built for it
    (at the H200 defaults one row of 16,384 tokens, the shape the longest requests replay).
    None without graphs or before warm-up has built any."""
    graphs = target.runner.graphs
    if graphs is None or not graphs.static:
        return None
    if isinstance(graphs, PackedGraphRunner):
        return (1, max(graphs.static))
    rows, tokens = max(graphs.static, key=lambda shape: (shape[1], shape[0]))
    return (rows, tokens)


class Requests:
    """Probe requests of chosen lengths, each with a state of its own: the richest schema the
    limits take where the length allows it, else the barest."""

    def __init__(self, target: WarmTarget) -> None:
        from clef_worker.starting.warm_requests import candidates

        self.target = target
        self.schemas = [request for request in candidates(target.limits)
                        if _fits(target, request)]
        self.floor = {id(schema): _fixed_length(target, schema) for schema in self.schemas}
        self._numbers = iter(range(1_000_000))

    @property
    def shortest(self) -> int:
        """The shortest request the barest schema makes (a one-token state)."""
        return self.floor[id(self.schemas[-1])] + 1

    def make(self, tokens: int, prefer_rich: bool = False) -> Encoding:
        rich, bare = self.schemas[0], self.schemas[-1]
        schema = rich if prefer_rich and tokens > self.floor[id(rich)] else bare
        tokens = min(max(tokens, self.floor[id(schema)] + 1), self.target.limits.max_length)
        return _encoding(self.target, schema, next(self._numbers), tokens)


def probe_groups(target: WarmTarget) -> list[list[Encoding]]:
    """The `groups` probe's requests, as the groups they are sent in (mixed, uniform, and with
    graphs the `largest_group`, last); empty when no request fits the limits."""
    return [group for group, _ in probe_plan(target)]


def probe_plan(target: WarmTarget) -> list[tuple[list[Encoding], tuple[int, int] | None]]:
    """`probe_groups`' groups, each with the graph shape it is forced into (None: cut and
    run as the serve loop would)."""
    requests = Requests(target)
    if not requests.schemas:
        return []
    room = min(target.policy.max_batch_tokens, target.limits.max_length, GROUP_ROOM)
    mixed = [requests.make(int(room * share), prefer_rich=i % 2 == 1)
             for i, share in enumerate(MIXED)]
    # One schema, one length: the encoder cuts each long state to exactly the same count.
    uniform = [requests.make(int(room * UNIFORM)) for _ in range(UNIFORM_COUNT)]
    plan: list[tuple[list[Encoding], tuple[int, int] | None]] = [(mixed, None), (uniform, None)]
    # Eagerly there is no fixed shape to fill: a forward is only as large as its requests.
    largest = largest_group(target, requests)
    if largest is not None:
        plan.append((largest, largest_shape(target)))
    return plan


def largest_group(target: WarmTarget, requests: Requests) -> list[Encoding] | None:
    """The requests forced into `largest_shape`: shares of LARGEST_REAL tokens (LARGEST_MIX),
    at most half the shape's tokens and one per row (padded) or `max_sequences` (packed),
    the last ones dropped until they fit the shape. None without graphs, or where even the
    shortest request the schemas make does not fit the largest shape (no request can then
    replay it: every longer one runs eagerly).

    Why short requests and not one near the largest length: served, the shape costs its full
    tokens however few are real, but the eager reference runs only the real ones, so the
    largest graph is checked for about 1,000 reference tokens instead of 16,000. A graph
    that reads its padding into the requests, or lays them at the wrong offsets, disagrees
    with their eager answers all the same."""
    shape = largest_shape(target)
    if shape is None:
        return None
    rows, tokens = shape
    graphs = target.runner.graphs
    count = rows if not isinstance(graphs, PackedGraphRunner) else graphs.max_sequences
    total = min(LARGEST_REAL, tokens // 2)
    group = [requests.make(max(int(total * share), requests.shortest), prefer_rich=i % 2 == 0)
             for i, share in enumerate(LARGEST_MIX[:max(count, 1)])]

    def fits(encodings: list[Encoding]) -> bool:
        lengths = [encoding.length for encoding in encodings]
        return (aligned_total(lengths) if isinstance(graphs, PackedGraphRunner)
                else max(lengths)) <= tokens

    while len(group) > 1 and not fits(group):
        group.pop()
    return group if fits(group) else None


def small_groups(target: WarmTarget) -> list[list[Encoding]]:
    """The `small` probe's requests (module docs): with graphs a lone `SMALL_LENGTH` request
    first; then the pairs of `SAME_BUCKET_PAIRS`, one after the other; then a pair of the
    shortest requests. Empty when no request fits the limits."""
    requests = Requests(target)
    if not requests.schemas:
        return []
    lone = [[requests.make(SMALL_LENGTH)]] if target.runner.graphs is not None else []
    pairs = [[requests.make(first), requests.make(second)]
             for first, second in SAME_BUCKET_PAIRS]
    shortest = [requests.make(requests.shortest), requests.make(requests.shortest)]
    return [*lone, *pairs, shortest]


def shape_of(target: WarmTarget, lengths: Sequence[int]) -> list[Any] | None:
    """The fixed shape a group of these lengths replays ([total tokens] of a packed bucket, or
    each padded forward's [rows, tokens]); None where it runs eagerly."""
    runner = target.runner
    graphs = runner.graphs
    if graphs is None:
        return None
    bucket_for = getattr(graphs, "bucket_for", None)
    if bucket_for is not None:
        bucket = bucket_for(lengths)
        return None if bucket is None else [bucket]
    shapes = [list(step.shape) for step in runner.plan(lengths) if step.shape is not None]
    return shapes or None


def _fits(target: WarmTarget, request: dict[str, Any]) -> bool:
    try:
        validate_request(request, target.limits)
        target.encode(request)
    except RequestInvalid:
        return False
    return True


def _fixed_length(target: WarmTarget, schema: dict[str, Any]) -> int:
    """The schema's tokens with a one-word state."""
    return target.encoder.encode({**schema, "state": "x"}, target.limits.max_length).length


# The first word of each probe request's state: distinct initials, so even requests cut to a
# one-token state (the shortest pair) differ from each other.
FIRST_WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel",
               "India", "Juliett", "Kilo", "Lima", "Mike", "November", "Oscar", "Papa",
               "Quebec", "Romeo", "Sierra", "Tango", "Uniform", "Victor", "Whiskey", "Xray",
               "Yankee", "Zulu")


def _encoding(target: WarmTarget, schema: dict[str, Any], number: int, tokens: int) -> Encoding:
    """Request `number` of the probe: the schema with a state of its own, cut to `tokens`."""
    sentences = tokens // 4 + 8  # every sentence is several tokens: more than enough to cut
    state = FIRST_WORDS[number % len(FIRST_WORDS)] + " " + "".join(
        f"Probe {number}-{k}: invoice #{number * 97 + k} was paid twice. "
        for k in range(sentences))
    return target.encoder.encode({**schema, "state": state}, tokens)
