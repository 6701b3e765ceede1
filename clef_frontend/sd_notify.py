"""systemd's service notification protocol (`Type=notify`), without libsystemd.

The protocol is one datagram of `KEY=value` lines sent to the unix socket named by
`$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace), so a few lines of socket code
replace a C dependency. Outside systemd the variable is unset and every call does nothing.

What clef-serve says, and when (see `ServiceNotifier`):
- `STATUS=` with what it is doing (loading and warming up the worker, serving, restarting, ...);
- `EXTEND_TIMEOUT_USEC=` every few seconds while the worker loads and warms up, so a 40-60 s
  warm-up does not trip `TimeoutStartSec` (the front's own `--startup-timeout` bounds it);
- `READY=1` once the listening socket accepts connections, never before;
- `STOPPING=1` when a stop signal starts the drain;
- `WATCHDOG=1` every half `$WATCHDOG_USEC` while the front's event loop runs and the worker is
  idle or within its request timeout, so systemd restarts a front that has stopped making
  progress.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("clef_frontend.sd_notify")

# While the worker starts: an extension every EXTEND_EVERY seconds, each for EXTEND_BY seconds.
EXTEND_EVERY = 10.0
EXTEND_BY = 30.0


class Notifier:
    """Sends notification datagrams to `address` (None: not under systemd, all no-ops)."""

    def __init__(self, address: str | None) -> None:
        self._address = _socket_address(address) if address else None
        self._socket: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_environment(cls) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, **fields: str | int) -> bool:
        """One datagram `KEY=value\\n...`; False (logged once) if it could not be sent."""
        if self._address is None:
            return False
        message = "".join(f"{key}={value}\n" for key, value in fields.items()).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX,
                                             socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.sendto(message, self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify the service manager: %s", exc)
                self._warned = True
            return False
        return True

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket_address(value: str) -> str | bytes:
    """`@name` is the abstract namespace (a leading NUL byte), anything else a path."""
    return b"\0" + value[1:].encode() if value.startswith("@") else value


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings (half of `$WATCHDOG_USEC`), or None when no watchdog is asked for
    this process (unset, not a positive number, or `$WATCHDOG_PID` names another process)."""
    env = os.environ if environ is None else environ
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2_000_000 if usec > 0 else None


def making_progress(in_flight_since: float | None, request_timeout: float, now: float) -> bool:
    """The worker is idle, or its current request is still within the request timeout.

    Past the timeout the front should already have killed the worker as hung; a request older
    than that (with a margin for the kill and its reaping) means the front itself is stuck.
    """
    return in_flight_since is None or now - in_flight_since <= request_timeout + EXTEND_BY


class ServiceNotifier:
    """The server's side of the protocol: what to say at each step of its life."""

    def __init__(self, notifier: Notifier, *, status: Callable[[], str | None],
                 healthy: Callable[[], bool]) -> None:
        self._notifier = notifier
        self._status = status
        self._healthy = healthy
        self._last_status = ""

    def say(self, text: str) -> None:
        self._last_status = text
        self._notifier.status(text)

    async def extend_while_starting(self) -> None:
        """Until cancelled: keep pushing the start timeout out while the worker warms up."""
        started = time.monotonic()
        while True:
            self._notifier.send(
                EXTEND_TIMEOUT_USEC=int(EXTEND_BY * 1_000_000),
                STATUS=f"loading and warming up the worker ({time.monotonic() - started:.0f}s)",
            )
            await asyncio.sleep(EXTEND_EVERY)

    def ready(self, address: str) -> None:
        self._last_status = f"serving on {address}"
        self._notifier.ready(self._last_status)

    def stopping(self) -> None:
        self._last_status = "draining"
        self._notifier.stopping("draining: finishing queued requests")

    async def watch(self, interval: float | None) -> None:
        """Until cancelled: ping the watchdog while healthy, and report state changes."""
        if not self._notifier.enabled:
            return
        period = interval if interval is not None else 1.0
        while True:
            if interval is not None and self._healthy():
                self._notifier.watchdog()
            text = self._status()
            if text is not None and text != self._last_status:
                self.say(text)
            await asyncio.sleep(period)
