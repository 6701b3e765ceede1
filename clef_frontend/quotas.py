"""Per-key quotas: a token bucket per key name, and the 429 a key over its rate gets.

A key with `rate = R` and `burst = B` (auth.py) may send B requests at once after a quiet
spell and R per second sustained. Over that it gets 429 with `Retry-After`: the whole seconds
until its bucket holds a token again (at least 1, as clients read the header as whole seconds),
so a client that honours it succeeds on its retry. Other keys are unaffected: each name has its
own bucket. A key rotation that keeps a name and its numbers keeps its bucket (a rotation is no
way around a quota); changed numbers start a full bucket.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from clef_api import responses
from clef_api.responses import Reply
from clef_frontend.auth import NamedKey


@dataclass
class TokenBucket:
    """`burst` tokens at most, `rate` more per second; each request takes one."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there will be."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Quotas:
    """The buckets of every key with a rate, by name."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, key: NamedKey, now: float | None = None) -> Reply | None:
        """None if `key` may send this request now, else its 429 (its token is not taken)."""
        if key.rate is None:
            return None
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(key.name)
        if bucket is None or (bucket.rate, bucket.burst) != (key.rate, key.burst):
            bucket = TokenBucket(key.rate, key.burst, key.burst, now)
            self._buckets[key.name] = bucket
        wait = bucket.take(now)
        if wait <= 0.0:
            return None
        return responses.error(
            429, f"key {key.name!r} is over its quota of {key.rate:g} requests per second "
                 f"(burst {key.burst:g})", retry_after=max(1, math.ceil(wait)))
