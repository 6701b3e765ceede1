"""When a request body has arrived too slowly: inactivity, plus a minimum average rate.

Why both: an inactivity timeout alone (the old rule) is reset by every byte, so a client that
trickles one byte a second holds a connection, its socket and its buffers for as long as its
Content-Length allows (months, near the 8 MiB limit). Like Kestrel's `MinRequestBodyDataRate` and
nginx's `client_body_timeout` plus `send_lowat`-style limits, the body must also keep an average
rate once a grace period has passed: at `t` seconds after the head, `rate * t` bytes must have
arrived (or the whole body, if it is shorter). The grace period lets a slow start, a TCP window
ramping up or a client pausing to compute, go unpunished.

Pure arithmetic over an injected clock reading, so the rule is tested without sleeping; the
connection only asks `wait_limit(now)` before each read and reports bytes with `received`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BodyRateRule:
    """The limits: seconds of silence allowed, and a minimum average rate after a grace period.

    `min_rate` of 0 disables the rate part (inactivity alone then applies, as before).
    """

    inactivity: float
    min_rate: float
    grace: float

    def start(self, now: float, expected: int) -> BodyClock:
        """The clock of one body of `expected` bytes, whose head ended at `now`."""
        return BodyClock(self, started=now, expected=expected, last_byte=now)


@dataclass
class BodyClock:
    """The progress of one body against a `BodyRateRule`."""

    rule: BodyRateRule
    started: float
    expected: int
    last_byte: float
    received: int = 0

    def record(self, count: int, now: float) -> None:
        """`count` more body bytes arrived at `now`."""
        if count > 0:
            self.received += count
            self.last_byte = now

    def rate_deadline(self) -> float:
        """The moment the average rate falls below the minimum if nothing more arrives.

        `received` bytes cover `received / min_rate` seconds of the rule; never before the grace
        period ends; never while the body is complete.
        """
        if self.rule.min_rate <= 0 or self.received >= self.expected:
            return float("inf")
        return self.started + max(self.rule.grace, self.received / self.rule.min_rate)

    def deadline(self) -> float:
        """The earlier of the inactivity deadline and the rate deadline (none once complete)."""
        if self.received >= self.expected:
            return float("inf")
        return min(self.last_byte + self.rule.inactivity, self.rate_deadline())

    def wait_limit(self, now: float) -> float:
        """How long the next read may wait (0 means the body is already too slow)."""
        return max(self.deadline() - now, 0.0)

    def too_slow(self, now: float) -> str | None:
        """None while within limits, else which limit was broken (for the log)."""
        if now >= self.last_byte + self.rule.inactivity:
            return f"no body byte for {self.rule.inactivity:g}s"
        if now >= self.rate_deadline():
            rate = self.received / max(now - self.started, 1e-9)
            return (f"body arrived at {rate:.0f} B/s, under the minimum "
                    f"{self.rule.min_rate:g} B/s after {self.rule.grace:g}s")
        return None
