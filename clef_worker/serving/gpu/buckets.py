"""Padded length buckets: a finite set of sequence shapes for every request length.

Why: on CUDA each distinct shape costs something (a graph capture, kernel plans, autotuning), and
requests arrive at arbitrary lengths. Right-padding the token ids to the next bucket gives a small
fixed set of shapes that warm-up can visit one by one. The Qwen3.5 text stack is causal (full
attention is masked causally, the Gated DeltaNet recurrence and its short convolution run left to
right), so the hidden states of the real tokens do not depend on anything appended after them;
the head then reads only the real positions. `tests/test_buckets.py` proves the invariance.

The table: multiples of `step` (64) up to `dense_limit` (1,024), where short requests sit and
padding is cheap in absolute terms; then steps of about `growth` (1.25x), rounded up to a
multiple of `step`, so the padding waste stays under 25 % while the bucket count grows only
logarithmically. The last bucket is exactly `max_length`, so every admissible request has one; a
geometric bucket within `near_max` (10 %) of it is dropped (15,552 beside 16,384 would cost a
graph, its pool share and its warm-up for at most 5 % less padding on the longest requests).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

DEFAULT_STEP = 64
DEFAULT_DENSE_LIMIT = 1024
DEFAULT_GROWTH = 1.25
DEFAULT_NEAR_MAX = 0.1


def bucket_lengths(
    max_length: int,
    *,
    step: int = DEFAULT_STEP,
    dense_limit: int = DEFAULT_DENSE_LIMIT,
    growth: float = DEFAULT_GROWTH,
    near_max: float = DEFAULT_NEAR_MAX,
) -> tuple[int, ...]:
    """The bucket table for a token budget: ascending, unique, the last one `max_length`."""
    if max_length < 1 or step < 1 or growth <= 1.0:
        raise ValueError(f"bad bucket parameters: max_length={max_length}, step={step}, "
                         f"growth={growth}")
    lengths: list[int] = []
    length = step
    while length < max_length:
        if length > dense_limit and length > max_length * (1.0 - near_max):
            break  # a geometric bucket just below max_length: max_length itself serves
        lengths.append(length)
        if length < dense_limit:
            length += step
        else:
            grown = int(length * growth)
            length = max(length + step, -(-grown // step) * step)
    lengths.append(max_length)
    return tuple(lengths)


# The packed graphs' table (`cost_bucket_lengths`): a replay costs about `fixed + tokens` token
# times, the fixed part being launches (the fit over the packed buckets' replays on an H200,
# 2026-12-04: 9.5 ms fixed and 23 us a token, i.e. 413 tokens' worth), and each step is kept
# within `DEFAULT_COST_RATIO` of that cost.
DEFAULT_FIXED_TOKENS = 413
DEFAULT_COST_RATIO = 0.12
COST_NEAR_MAX = 0.05


def cost_bucket_lengths(
    max_length: int,
    *,
    step: int = DEFAULT_STEP,
    fixed_tokens: int = DEFAULT_FIXED_TOKENS,
    ratio: float = DEFAULT_COST_RATIO,
    near_max: float = COST_NEAR_MAX,
) -> tuple[int, ...]:
    """Buckets spaced by what padding costs in time, not in tokens: the step after a bucket of
    `b` tokens is `ratio x (fixed_tokens + b)` rounded up to a multiple of `step` (at least
    `step`), so a forward padded to the next bucket runs at most about `ratio` longer than one
    of its own length would. Small buckets, whose replay is mostly fixed cost, are spaced
    wider than `bucket_lengths` spaces them (128 from 192 tokens on, where 64 bought about 3 %)
    and large ones closer (about 1.12x instead of 1.25x), for about as many shapes. The last
    bucket is `max_length`; one within `near_max` of it is dropped."""
    if max_length < 1 or step < 1 or fixed_tokens < 0 or ratio <= 0.0:
        raise ValueError(f"bad bucket parameters: max_length={max_length}, step={step}, "
                         f"fixed_tokens={fixed_tokens}, ratio={ratio}")
    lengths: list[int] = []
    length = step
    while length < max_length and length <= max_length * (1.0 - near_max):
        lengths.append(length)
        grown = -(-int(ratio * (fixed_tokens + length)) // step) * step
        length += max(step, grown)
    lengths.append(max_length)
    return tuple(lengths)


@dataclass(frozen=True)
class BucketTable:
    """Which padded length a request of `n` tokens runs at.

    `lengths` may stop below the token budget (a capture limit): longer requests get no bucket
    and run unpadded and eagerly (`select` returns None).
    """

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or list(self.lengths) != sorted(set(self.lengths)) \
                or self.lengths[0] < 1:
            raise ValueError(f"bucket lengths must be ascending positive integers: {self.lengths}")

    @classmethod
    def for_budget(cls, max_length: int, limit: int | None = None) -> BucketTable:
        """The default table up to `max_length`, cut at `limit` tokens when one is given."""
        lengths = bucket_lengths(max_length)
        if limit is not None:
            kept = tuple(length for length in lengths if length <= limit)
            lengths = kept or lengths[:1]
        return cls(lengths)

    @property
    def largest(self) -> int:
        return self.lengths[-1]

    def select(self, length: int) -> int | None:
        """The smallest bucket holding `length` tokens; None above the largest (run eagerly)."""
        if length < 1:
            raise ValueError(f"a sequence has at least one token, got {length}")
        position = bisect_left(self.lengths, length)
        return self.lengths[position] if position < len(self.lengths) else None

    def padding(self, length: int) -> int:
        """How many pad tokens a request of `length` tokens gets (0 above the largest)."""
        bucket = self.select(length)
        return 0 if bucket is None else bucket - length
