"""Server settings, fixed once at start-up.

One frozen dataclass so every component reads the same values and nothing can change them while
requests are in flight. `cli.py` builds it from flags; tests can build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clef_api.checks import DEFAULT_BODY_LIMIT
from clef_dispatch import WorkerSettings
from clef_frontend.answer_cache import DEFAULT_CACHE_BYTES
from clef_frontend.body_rate import BodyRateRule
from clef_frontend.priority import check_objective_classes
from clef_protocol.frames import MAX_FRAME_BYTES
from clef_protocol.options import RequestLimits

# Bytes a `request` frame adds around the body (msgpack map, kind, id); generous on purpose.
FRAME_ENVELOPE_HEADROOM = 64 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """Everything the front needs to know; see `cli.py` for the meaning of each flag."""

    # The workers: where they run, how they are started, fed, judged, replaced and stopped
    # (clef_dispatch.WorkerSettings owns those fields, their meaning and their checks).
    workers: WorkerSettings
    limits: RequestLimits = field(default_factory=RequestLimits)
    host: str = "127.0.0.1"
    port: int = 8000
    backlog: int = 2048
    metrics_port: int | None = None
    body_limit: int = DEFAULT_BODY_LIMIT
    header_limit: int = 16 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: float = 1024.0
    body_rate_grace: float = 5.0
    keepalive_timeout: float = 5.0
    send_timeout: float = 30.0
    queue_size: int = 64
    retry_after: int = 1
    drain_timeout: float = 30.0
    served_model_names: tuple[str, ...] = ("clef-flash",)  # the served name, then aliases
    finetune_names: tuple[str, ...] = ()  # the fine-tuned variants' names (--finetune)
    finetune_given: bool = False  # --finetune given (its directories may hold none yet)
    api_key_file: str | None = None
    api_key: str | None = field(default=None, repr=False)  # CLEF_API_KEY; never printed
    # Shared traffic: requests wait at most `queue_timeout` seconds for a worker (None: no
    # limit); `answer_cache` answers kept for repeats (0: no cache, and no sharing of identical
    # requests in flight).
    queue_timeout: float | None = None
    # A modest bound (answers are a few KiB): enough for retries and score-then-compact pairs,
    # not for whole eval sweeps.
    answer_cache: int = 1024
    # ...and the bytes they may hold together (bodies and keys): answers with many options run
    # to tens of KB, so a count alone does not bound the memory (the cache owns the default).
    answer_cache_bytes: int = DEFAULT_CACHE_BYTES
    # Behind the inference gateway: InferenceObjective names mapped to priority classes
    # (--objective-class NAME=CLASS; priority.py owns the rule). Empty: objectives are ignored.
    objective_classes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # A body that fits the HTTP limit must also fit one frame, or the worker channel would
        # refuse a request the front already accepted.
        if self.body_limit + FRAME_ENVELOPE_HEADROOM > MAX_FRAME_BYTES:
            raise ValueError(
                f"--body-limit {self.body_limit} does not fit a worker frame: the maximum is "
                f"{MAX_FRAME_BYTES - FRAME_ENVELOPE_HEADROOM} bytes"
            )
        for name in ("body_limit", "header_limit", "queue_size", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout", "send_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.body_min_rate < 0 or self.body_rate_grace < 0:
            raise ValueError("--body-min-rate and --body-rate-grace must be >= 0")
        if self.drain_timeout < 0 or self.retry_after < 0:
            raise ValueError("--drain-timeout and --retry-after must be >= 0")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError("--queue-timeout must be positive")
        check_objective_classes(self.objective_classes)
        if self.answer_cache < 0:
            raise ValueError("--answer-cache must be >= 0")
        if self.answer_cache_bytes < 1:
            raise ValueError("--answer-cache-bytes must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} is not a TCP port")

    @property
    def finetune(self) -> bool:
        """Fine-tuned variants are configured: a body's `model` chooses the model."""
        return self.finetune_given or bool(self.finetune_names)

    @property
    def body_rate_rule(self) -> BodyRateRule:
        """How slowly a request body may arrive (body_rate.py)."""
        return BodyRateRule(self.body_timeout, self.body_min_rate, self.body_rate_grace)
