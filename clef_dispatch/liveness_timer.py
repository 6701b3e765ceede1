"""The one timer that watches a ready worker: it pings it, judges its silence by liveness.py's
rule, and says when it is suspect, healthy again, or wedged.

Apart from the channel (worker_channel.py), which owns the pipe and the replies: the channel
tells the timer what it sends and what comes back (`request_sent`, `pong`, `answered`), and the
timer writes pings and breaks the channel through the two callables it was given. One timer
handle per worker, aimed at the sooner of the next ping and the moment the verdict would change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from clef_dispatch.liveness import Judgement, Liveness, Verdict, ping_interval
from clef_dispatch.worker_errors import WorkerExited, WorkerFailure, WorkerStalled
from clef_protocol import messages


class LivenessTimer:
    """Pings (when the worker answers them) and judgements for one ready worker.

    `write` queues a frame on the worker's pipe (False: the pipe is gone); `fail` breaks the
    channel; `in_flight` counts the requests it holds (for the log line of a wedge);
    `on_suspect` hears each change of suspicion (True: suspect, False: healthy again)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, liveness: Liveness, *, pings: bool,
                 write: Callable[[dict[str, Any]], bool],
                 fail: Callable[[WorkerFailure], None], in_flight: Callable[[], int],
                 on_suspect: Callable[[bool], None]) -> None:
        self._loop = loop
        self.liveness = liveness
        self._pings = pings
        self._write = write
        self._fail = fail
        self._in_flight = in_flight
        self._on_suspect = on_suspect
        self._ping_seq = 0
        self.ping_waiting: int | None = None  # the ping awaiting its pong
        self.suspect: Judgement | None = None
        self._suspect_since = 0.0
        self.wedged = False
        self._handle: asyncio.TimerHandle | None = loop.call_at(loop.time(), self._tick)

    @property
    def suspect_for(self) -> float:
        """Seconds since the worker became suspect (0 when it is not)."""
        return self._loop.time() - self._suspect_since if self.suspect is not None else 0.0

    def request_sent(self, frame_id: int, body_bytes: int) -> bool:
        """A request goes to the worker; a fresh ping goes ahead of it (unless one is owed): an
        idle worker owes its pong at once, so one that wedged since its last pong is suspect
        within the floor, whatever the request's length. False if the pipe is gone."""
        if self._pings and self.ping_waiting is None and not self._send_ping():
            return False
        self.liveness.request_sent(frame_id, body_bytes)
        self._look_sooner()
        return True

    def pong(self, seq: int) -> bool:
        """A pong came; False if none with this number was owed (a protocol error)."""
        if self.ping_waiting is None or seq != self.ping_waiting:
            return False
        self.ping_waiting = None
        self.liveness.pong()
        self._sign_of_life()
        return True

    def answered(self, reply: messages.WorkerReply) -> None:
        """A request was answered: its forward teaches the rates, and it is a sign of life."""
        self.liveness.request_answered(reply.id, reply.input_tokens, reply.worker_ms,
                                       cut=reply.truncated_tokens > 0)
        self._sign_of_life()

    def stop(self) -> None:
        self.suspect = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    # -- internals ---------------------------------------------------------------------------

    def _sign_of_life(self) -> None:
        """A suspect is judged again now (healthy again unless it still owes something
        overdue), and the timer may have to look sooner."""
        if self.suspect is not None:
            self._judge(self.liveness.judge())
        self._look_sooner()

    def _tick(self) -> None:
        """Judge the silence, then ping if one is due; look again when the verdict would
        change or the next ping is due, whichever is sooner."""
        self._handle = None
        liveness = self.liveness
        if not self._judge(liveness.judge()):
            return
        if self._pings and liveness.ping_due() and not self._send_ping():
            return
        self._handle = self._loop.call_at(self._next_look(), self._tick)

    def _next_look(self) -> float:
        """When the verdict would change or the next ping is due, whichever is sooner."""
        liveness = self.liveness
        looks = [liveness.judge().next_look, liveness.next_ping_at() if self._pings else None]
        return min((look for look in looks if look is not None),
                   default=self._loop.time() + liveness.stall_timeout / 3)

    def _look_sooner(self) -> None:
        """After a pong, a reply or a request the verdict may change sooner than the timer is
        aimed (the next ping is due, the margin shrank or became known): the timer looks again
        within a ping interval. Not judged here: a judgement costs a hundred microseconds with
        a full batch held, too much for every reply."""
        if self._handle is None:
            return
        soon = self._loop.time() + ping_interval(self.liveness.stall_timeout)
        if soon < self._handle.when():
            self._handle.cancel()
            self._handle = self._loop.call_at(soon, self._tick)

    def _send_ping(self) -> bool:
        """Write a ping (none may be owed); False if the pipe is gone (the channel broke)."""
        self._ping_seq += 1
        self.ping_waiting = self._ping_seq
        self.liveness.ping_sent()
        if not self._write(messages.ping(self._ping_seq)):
            self._fail(WorkerExited("worker closed its input"))
            return False
        return True

    def _judge(self, judgement: Judgement) -> bool:
        """Act on a verdict: break the channel if wedged (False), else track the suspicion and
        tell `on_suspect` of each change (True)."""
        stall = self.liveness.stall_timeout
        if judgement.verdict is Verdict.WEDGED:
            self.wedged = True
            held = f"({self._in_flight()} request(s) in flight)"
            if judgement.kill_after >= stall:
                self._fail(WorkerStalled(f"no pong and no reply within {stall:g}s {held}"))
            else:
                self._fail(WorkerStalled(f"no pong within {judgement.kill_after:g}s with no "
                                         f"request ahead of it {held}"))
            return False
        was_suspect = self.suspect is not None
        if judgement.verdict is Verdict.SUSPECT:
            if not was_suspect:
                self._suspect_since = self._loop.time()
            self.suspect = judgement
            if not was_suspect:
                self._on_suspect(True)
        elif was_suspect:
            self.suspect = None
            self._on_suspect(False)
        return True
