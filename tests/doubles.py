"""Test doubles shared by several test modules, so no test module imports another.

`FakeLane` / `FakeWorkers`: workers as admission sees them (`dispatch.admission.Lane` and
`Workers`), answered or crashed by the test. `Door`: the real admission queue behind the
dispatcher's door, for a pipeline under test. `ScriptedExecutor`: a model-free executor for the
worker loop, answering by the request's `do` key. `break_suffix_positions`: a silent fault in
the prefixed forward, for the prefix cache's start-up probe.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from clef_api.responses import Reply, from_outcome
from clef_dispatch import admission
from clef_dispatch.admission import Ticket
from clef_dispatch.outcomes import Refusal
from clef_dispatch.ticket import TicketView, ticket_of
from clef_dispatch.worker_errors import Deliver, WorkerFailure
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.messages import ModelInfo, Request, WorkerReply
from clef_worker.errors import ExecutorBroken
from clef_worker.serving.executor import Answer


class Admission(admission.Admission):
    """The real admission queue, whose `submit` returns the Ticket: a test that expects a
    refusal uses `admission.Admission` itself."""

    def submit(self, *args: Any, **kwargs: Any) -> Ticket:
        ticket = super().submit(*args, **kwargs)
        assert isinstance(ticket, Ticket), ticket
        return ticket



class Door:
    """The door a `Dispatcher` is to the pipeline, over the real admission queue: `submit`
    hands out the read-only `TicketView`, `abandon` takes it back."""

    def __init__(self, queue: admission.Admission) -> None:
        self.queue = queue

    @property
    def draining(self) -> bool:
        return self.queue.draining

    def submit(self, *args: Any, **kwargs: Any) -> TicketView | Refusal:
        ticket = self.queue.submit(*args, **kwargs)
        return ticket if isinstance(ticket, Refusal) else TicketView(ticket)

    def abandon(self, ticket: TicketView) -> None:
        self.queue.abandon(ticket_of(ticket))


async def reply_of(ticket: Ticket) -> Reply:
    """The ticket's outcome, as the HTTP API answers it."""
    return from_outcome(await ticket.outcome)


class FakeLane:
    """A worker as admission sees it: holds up to `room` requests until the test answers."""

    def __init__(self, room: int, prefix_slot: str | None = None,
                 variants: tuple[str, ...] = ()) -> None:
        self.room = room
        self.prefix_slot = prefix_slot  # its name for the prefix affinity rule (None: no cache)
        self.ready = True
        self.variants = set(variants)  # the fine-tuned variants its worker serves
        self.held: list[tuple[Request, Deliver]] = []
        self.sent: list[bytes] = []

    def has_room(self) -> bool:
        return self.ready and len(self.held) < self.room

    def serves(self, model: str) -> bool:
        return not model or model in self.variants

    def weights_of(self, model: str) -> str | None:
        return "" if self.serves(model) else None

    @property
    def max_batch(self) -> int:
        return self.room

    @property
    def in_flight(self) -> int:
        return len(self.held)

    def submit(self, request: Request, deliver: Deliver) -> None:
        self.held.append((request, deliver))
        self.sent.append(request.body)

    def answer_oldest(self) -> None:
        request, deliver = self.held.pop(0)
        deliver(WorkerReply(200, request.body, None, 0.0, id=request.id))

    def crash(self) -> None:
        held, self.held = self.held, []
        for _, deliver in held:
            deliver(WorkerFailure("worker closed its output"))


class FakeWorkers:
    """All workers (`dispatch.admission.Workers`): available while one lane is ready."""

    def __init__(self, *lanes: FakeLane) -> None:
        self.lanes = list(lanes)

    def unavailable_reason(self) -> str | None:
        return None if any(lane.ready for lane in self.lanes) else "worker is restarting"

    def serving(self, model: str) -> bool:
        return any(lane.ready and lane.serves(model) for lane in self.lanes)

    def knows(self, model: str) -> bool:
        return any(model in lane.variants for lane in self.lanes)


class ScriptedExecutor:
    """Answers by the request's `do` key; records the thread each call ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def describe(self) -> ModelInfo:
        return ModelInfo(model="t", variant="clef-flash", device="cpu", dtype="float32",
                         gdn_path="torch")

    def warm_up(self) -> None:
        pass

    def answer(self, body: bytes) -> Answer:
        self.threads.append(threading.current_thread().name)
        do = json.loads(body).get("do")
        if do == "invalid":
            raise RequestInvalid("q: nope")
        if do == "badjson":
            raise BadRequestBody("request must be a JSON object")
        if do == "boom":
            raise RuntimeError("secret internal detail")
        if do == "poisoned":
            raise ExecutorBroken("CUDA error: an illegal memory access was encountered")
        return Answer(b'{"echo":' + body + b"}", input_tokens=len(body),
                      truncated_tokens=int(do == "cut"))


def break_suffix_positions(monkeypatch: Any) -> None:
    """A prefixed forward whose new tokens' positions restart at 0 (a plausible bug that raises
    nothing; clef_worker.model.prefix_forward)."""
    from clef_worker.model.prefix_forward import SequencePlan

    def restarted(plan: SequencePlan) -> int:
        if plan.prefix is None or plan.points:
            return plan.prefix.start if plan.prefix is not None else 0
        return 0

    monkeypatch.setattr(SequencePlan, "start", property(restarted))
