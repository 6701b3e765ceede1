"""The Prometheus text format (0.0.4) of the front's registry, written cheaply, and the metrics
port's server.

Why not prometheus_client's `generate_latest`: an endpoint picker scrapes every pod every 50 ms
and counts a pod whose metrics are 200 ms old as full, so a scrape must stay fast while the
front is busiest. `generate_latest` spent about 5 ms on the front's ~150 samples (measured on
the 2-core development box under other load, `bench/bench_metrics_under_load.py`), most of it
checking every metric and label name against a regular expression, per sample, per scrape.
Here the front's own names are known to be valid Prometheus names (they are constants of
metrics.py), so names are written as they are, label values escaped only when they hold a
character that needs it, and the `_created` series (a sample per counter and histogram child,
which the text format carries as extra gauges nobody reads) are left out. The output parses to
the same samples otherwise (tests/test_load_gauges.py compares the two).

The metrics port (`--metrics-port`) is served by a small threaded HTTP server of the standard
library answering every GET with this text, on its own thread: a scrape there never waits for
the event loop's turn, only for the GIL.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.utils import floatToGoString

_SUFFIXED = {"counter": "_total", "info": "_info"}
_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
          "unknown": "untyped"}


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return value


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the text format, without `_created` series."""
    out: list[str] = []
    append = out.append
    for family in registry.collect():
        name = family.name + _SUFFIXED.get(family.type, "")
        help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        append(f"# HELP {name} {help_text}\n# TYPE {name} "
               f"{_TYPES.get(family.type, family.type)}\n")
        created = family.name + "_created"
        for sample in family.samples:
            if sample.name == created:
                continue
            labels = sample.labels
            if labels:
                pairs = ",".join(f'{key}="{_escape_value(labels[key])}"'
                                 for key in sorted(labels))
                append(f"{sample.name}{{{pairs}}} {floatToGoString(sample.value)}\n")
            else:
                append(f"{sample.name} {floatToGoString(sample.value)}\n")
    return "".join(out).encode("utf-8")


class _Handler(BaseHTTPRequestHandler):
    """Every GET answers the text format: of the registry its path names in `paths`, else of
    the whole `registry`; nothing is logged."""

    protocol_version = "HTTP/1.1"  # keep-alive for scrapers that reuse connections
    # Small answers must leave at once: with Nagle's algorithm a write could wait for the
    # client's delayed ACK of the previous one (40 ms on Linux) on a kept-alive connection.
    disable_nagle_algorithm = True
    registry: CollectorRegistry
    paths: dict[str, CollectorRegistry]

    def do_GET(self) -> None:
        body = render(self.paths.get(self.path.split("?", 1)[0], self.registry))
        # One write for head and body: each blocking call gives the GIL up, and while the event
        # loop is busy, taking it back can cost a switch interval (5 ms).
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        self.wfile.write(head.encode("ascii") + body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one every 50 ms per picker)."""


def serve(registry: CollectorRegistry, host: str, port: int,
          paths: dict[str, CollectorRegistry] | None = None) -> ThreadingHTTPServer:
    """Serve `registry` on `host:port` (0: any free port) from a daemon thread, and the
    registries of `paths` on those paths."""
    handler = type("MetricsHandler", (_Handler,), {"registry": registry, "paths": paths or {}})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    return server
