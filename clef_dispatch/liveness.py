"""When a silent worker becomes suspect, and when it is wedged: the rule, pure (clock injected).

Why two steps. `--stall-timeout` (30 s) must stay far above the longest live forward, or a slow
but live worker is killed; yet on an H200 a forward takes milliseconds, and a client with a 5 s
timeout cannot wait 30 s for a wedged worker's replacement. So a worker whose next sign of life
(a `pong`, or a reply) is overdue by a short, measured margin becomes *suspect*: it gets no new
work and the requests it holds are sent to another worker at once (admission), but it is not
killed; it is healthy again the moment it answers. It is killed only at `--stall-timeout` (as
before), or earlier when nothing it could be running explains the silence.

What the front waits for, and by when. The worker reads its pipe in order and answers a `ping`
at once while it gathers requests and between forwards, never during one. So:

- while a ping awaits its pong, the pong is due once the worker has got through the requests
  sent *before* that ping (those after it cannot delay it), counted from the ping or from the
  last sign of life since, whichever is later;
- with no ping waiting (the worker does not answer pings, or the next ping is not due yet), the
  next reply is due once the worker has got through every request it holds, counted from the
  last sign of life or from the moment the front began waiting, whichever is later.

The margin for a set of requests is `ESTIMATE_FACTOR` times their estimated forward time, never
less than `FLOOR_SECONDS` (scheduling noise, a pause of the garbage collector) and never more
than the stall timeout. A request's estimated time comes from its worker slot's recent forwards
(`ForwardRates`), per unit of size: the body's bytes stand for its tokens (the front does not
tokenize), and a forward is scaled to the request's size from recent ones of about the same size
(within a factor of two), else from the fastest bigger one (a bigger forward bounds a smaller
one), else linearly up from the smaller ones (which also scales up their fixed cost, so errs
long). A forward whose state was cut to fit `--max-length` (its reply's `truncated_tokens`)
bounds every bigger body. The estimate errs
long on purpose (a forward's time is the whole group's, charged to each request of it, and the
slowest of the recent ones counts), so it is never less than the longest forward the worker is
known to be running. Without any recent forward the time of held work is unknown: the margin is
then the stall timeout (such a worker is suspected only through a pong owed with nothing ahead;
the channel sends a ping ahead of every request that finds none owed, so an idle worker that
wedged is caught by its pong whatever the request).

Killing. At `--stall-timeout` of silence while the front waits, as always (reason `stalled`).
Earlier only when the silence cannot be a forward: the worker owes a pong with no request ahead
of it; then it is killed once silent for `idle_kill_after` (a third of the stall timeout, at
least `IDLE_KILL_SECONDS`). A worker with a forward ahead of it is never killed before the stall
timeout by this rule, however wrong the estimate, so a slow but live forward is never killed.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# The least margin before a silent worker is suspect: a pong owed by an idle worker comes in
# well under a millisecond, so half a second is scheduling noise (a loaded host, a collector
# pause) many times over, yet short enough that a client with a 5 s timeout is answered
# elsewhere in time.
FLOOR_SECONDS = 0.5
# How many times its estimated forward time a worker may take before it is suspect.
ESTIMATE_FACTOR = 2.0
# A worker that owes a pong with no request ahead of it, silent this long, is wedged (unless a
# third of the stall timeout is longer): ten floors, so a pause of the host is not a kill.
IDLE_KILL_SECONDS = 5.0
# Pings go out this often (at most; a third of the stall timeout if shorter), so an idle worker
# that wedges is suspect within PING + FLOOR of its last pong.
PINGS_PER_FLOOR = 2
# Recent forwards kept per worker slot for the estimate.
RATE_WINDOW = 32
# A timer may fire a hair early (the loop's clock resolution): the next look is aimed this much
# past the moment the verdict changes, so it never finds the old verdict and looks again at once.
LOOK_LATE = 1e-3


def ping_interval(stall_timeout: float) -> float:
    """Seconds between pings: half the floor, or a third of the stall timeout if shorter."""
    return min(FLOOR_SECONDS / PINGS_PER_FLOOR, stall_timeout / 3)


def idle_kill_after(stall_timeout: float) -> float:
    """Seconds of silence after which a worker that owes a pong with nothing ahead is killed."""
    return min(stall_timeout, max(IDLE_KILL_SECONDS, stall_timeout / 3))


@dataclass(frozen=True)
class _Forward:
    body_bytes: int
    seconds: float
    cut: bool  # the worker read `--max-length` tokens: any bigger body costs the same


class ForwardRates:
    """One worker slot's recent forwards, for the estimate of the work a worker holds.

    Kept by the slot, not the process: a replacement runs the same model on the same device, so
    its predecessor's forwards are the best guess until it has answered some of its own.
    """

    def __init__(self, window: int = RATE_WINDOW) -> None:
        self._forwards: deque[_Forward] = deque(maxlen=window)

    def observe(self, body_bytes: int, tokens: int, worker_ms: float | None,
                cut: bool = False) -> None:
        """A response: its body's size, the tokens the worker read, the milliseconds it took,
        and whether its state was cut to fit `--max-length`."""
        if worker_ms is None or tokens <= 0 or body_bytes <= 0 or worker_ms < 0:
            return  # refusals and older workers say nothing about forwards
        self._forwards.append(_Forward(body_bytes, worker_ms / 1000.0, cut))

    @property
    def known(self) -> bool:
        return bool(self._forwards)

    def estimate(self, body_bytes: int) -> float | None:
        """Seconds a request of `body_bytes` may take (erring long); None: nothing observed."""
        if not self._forwards:
            return None
        size = max(body_bytes, 1)
        near = [f.seconds * (1.0 if f.cut else max(1.0, size / f.body_bytes))
                for f in self._forwards
                if size / 2 <= f.body_bytes <= 2 * size or (f.cut and f.body_bytes <= size)]
        if near:
            return max(near)
        bigger = [f.seconds for f in self._forwards if f.body_bytes > 2 * size]
        if bigger:
            return min(bigger)
        return max(f.seconds * size / f.body_bytes for f in self._forwards)


class Verdict(enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    WEDGED = "wedged"


@dataclass(frozen=True)
class Judgement:
    """Where a worker stands now: `silent` seconds without a sign of life while the front
    waits, `allowed` before it is suspect, `kill_after` before it is wedged; `next_look` is the
    clock time at which the verdict changes if nothing else happens (None: not waiting);
    `reason` says what is owed, for logs and /health."""

    verdict: Verdict
    silent: float = 0.0
    allowed: float = 0.0
    kill_after: float = 0.0
    next_look: float | None = None
    reason: str = ""


HEALTHY = Judgement(Verdict.HEALTHY)


@dataclass
class _Held:
    order: int
    body_bytes: int


class Liveness:
    """One worker's obligations (pong owed, requests held) and the judgement of its silence."""

    def __init__(self, *, stall_timeout: float, rates: ForwardRates,
                 clock: Callable[[], float]) -> None:
        self._stall = stall_timeout
        self._rates = rates
        self._clock = clock
        self._order = itertools.count()
        self._held: dict[int, _Held] = {}  # request id -> what it is; insertion order
        self._ping: tuple[int, float] | None = None  # (order, sent at) of the ping owed a pong
        self._last_ping = -float("inf")
        self._last_life = clock()
        self._waiting_since = self._last_life

    @property
    def stall_timeout(self) -> float:
        return self._stall

    # -- what happens ------------------------------------------------------------------------

    def life(self) -> None:
        """Any valid frame from the worker."""
        self._last_life = self._clock()

    def request_sent(self, request_id: int, body_bytes: int) -> None:
        if not self._waiting():
            self._waiting_since = self._clock()  # silence counts only while the front waits
        self._held[request_id] = _Held(next(self._order), body_bytes)

    def request_answered(self, request_id: int, tokens: int = 0,
                         worker_ms: float | None = None, cut: bool = False) -> None:
        """A reply (a response or an error): a sign of life, and a forward to learn from."""
        self.life()
        held = self._held.pop(request_id, None)
        if held is not None:
            self._rates.observe(held.body_bytes, tokens, worker_ms, cut)

    def ping_due(self) -> bool:
        """Whether to send a ping now: none is owed, and the last went out a while ago."""
        return (self._ping is None
                and self._clock() - self._last_ping >= ping_interval(self._stall) - 1e-9)

    def ping_sent(self) -> None:
        now = self._clock()
        if not self._waiting():
            self._waiting_since = now
        self._ping = (next(self._order), now)
        self._last_ping = now

    def pong(self) -> None:
        self.life()
        self._ping = None

    # -- judgement ---------------------------------------------------------------------------

    def next_ping_at(self) -> float | None:
        """When the next ping is due (None while one is owed)."""
        return None if self._ping is not None else self._last_ping + ping_interval(self._stall)

    def judge(self) -> Judgement:
        """The verdict now; see the module docstring for the rule."""
        if not self._waiting():
            return HEALTHY
        now = self._clock()
        if self._ping is not None:
            order, sent_at = self._ping
            ahead = [held for held in self._held.values() if held.order < order]
            anchor = max(self._last_life, sent_at)
            owed = "pong"
        else:
            ahead = list(self._held.values())
            anchor = max(self._last_life, self._waiting_since)
            owed = "reply"
        silent = now - anchor
        allowed = self._margin(ahead)
        kill_after = self._stall if ahead else idle_kill_after(self._stall)
        work = (f"{len(ahead)} request(s) ahead, allowed {allowed:.2f}s" if ahead
                else f"nothing ahead, allowed {allowed:.2f}s")
        reason = f"no {owed} for {silent:.2f}s ({work})"
        if silent >= kill_after:
            return Judgement(Verdict.WEDGED, silent, allowed, kill_after, None, reason)
        if silent > allowed:
            return Judgement(Verdict.SUSPECT, silent, allowed, kill_after,
                             anchor + kill_after + LOOK_LATE, reason)
        return Judgement(Verdict.HEALTHY, silent, allowed, kill_after,
                         anchor + allowed + LOOK_LATE, reason)

    def _waiting(self) -> bool:
        return self._ping is not None or bool(self._held)

    def _margin(self, ahead: list[_Held]) -> float:
        """Seconds the worker may take to get through `ahead` before it is suspect."""
        if not ahead:
            return min(FLOOR_SECONDS, self._stall)
        estimates = [self._rates.estimate(held.body_bytes) for held in ahead]
        if any(estimate is None for estimate in estimates):
            return self._stall
        total = sum(estimate for estimate in estimates if estimate is not None)
        return min(self._stall, max(FLOOR_SECONDS, ESTIMATE_FACTOR * total))
