"""How long to wait before restarting a worker that died, and why.

Why this rule: exponential back-off exists for crash loops, where restarting at once only burns
CPU and GPU on warm-ups that die again. A worker that answered requests before it died is not in
a crash loop: it was killed from outside (the OOM killer, an operator, a bad request) after useful
work, and delaying its replacement only lengthens the outage. The old rule (only 60 s of uptime
resets the count) made a host hit by repeated kills under load compound its own outages
(kill-to-ready 4.2 → 19.3 s over six kills, each worker having served about 100 requests).

So a death counts towards the back-off only when the worker answered no request successfully
since its `ready` (or never became ready); a worker that served, or that stayed up for
`reset_after` seconds, resets the count. Pure: the supervisor reports what it saw, this decides.
"""

from __future__ import annotations

from dataclasses import dataclass

# 2**32 * initial is already far beyond any cap; bounding the exponent keeps the float finite.
_MAX_EXPONENT = 32


@dataclass(frozen=True)
class RestartDecision:
    """The delay before the next start, and the reason for the log."""

    delay: float
    reason: str


@dataclass
class RestartBackoff:
    """Consecutive crash-loop failures, and the delays they earn (doubling, capped)."""

    initial: float
    cap: float
    reset_after: float
    failures: int = 0

    def worker_died(self, *, uptime: float, served: int) -> RestartDecision:
        """A ready worker died after `uptime` seconds, having answered `served` requests."""
        if served > 0:
            reason = f"served {served} request{'s' if served != 1 else ''} before dying"
        elif uptime >= self.reset_after:
            reason = f"up {uptime:.0f}s before dying"
        else:
            return self._next("crash loop: no request answered")
        # Not a crash loop: the count starts over, and this death is not part of it.
        self.failures = 0
        return RestartDecision(self.initial, reason)

    def start_failed(self) -> RestartDecision:
        """A replacement died or gave up before `ready`: always a crash-loop failure."""
        return self._next("crash loop: the replacement failed during start-up")

    def _next(self, reason: str) -> RestartDecision:
        delay = min(self.cap, self.initial * float(2 ** min(self.failures, _MAX_EXPONENT)))
        self.failures += 1
        if self.failures > 1:
            reason = f"{reason} ({self.failures} consecutive failures)"
        return RestartDecision(delay, reason)
