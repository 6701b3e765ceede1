"""The inference gateway's headers: the fairness id is the request's tenant on its access line
and span; an operator's --objective-class maps objective names to clef's priority classes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from clef_frontend import priority
from clef_frontend.gateway import NO_TENANT, tenant_of
from tests.frontend_helpers import Serve, clef_body
from tests.otlp_collector import Collector, http_collector
from tests.test_priority import _queue
from tests.test_traces import FAST_EXPORT, _has_request, _server_span

FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"


# -- the rules -----------------------------------------------------------------------------------


def test_a_tenant_is_one_safe_token_or_none() -> None:
    assert tenant_of(None) == NO_TENANT
    assert tenant_of(b" team-a ") == "team-a"
    assert tenant_of(b"two words") == NO_TENANT  # would split the key=value line
    assert tenant_of(b"x" * 129) == NO_TENANT
    assert tenant_of(b"caf\xe9") == NO_TENANT


def test_objective_names_map_to_classes_and_unknown_ones_are_ignored() -> None:
    classes = (("clef-bulk", priority.BULK), ("clef-interactive", priority.INTERACTIVE))
    assert priority.from_objective(b"clef-bulk", classes, priority.INTERACTIVE) == priority.BULK
    assert priority.from_objective(b"other", classes, priority.BULK) == priority.BULK
    assert priority.from_objective(None, classes, priority.INTERACTIVE) == priority.INTERACTIVE
    assert priority.from_objective(b"clef-bulk", (), priority.INTERACTIVE) == priority.INTERACTIVE


@pytest.mark.parametrize("text", ["clef-bulk", "=bulk", "Upper=bulk", "a=urgent", "a b=bulk"])
def test_a_malformed_objective_class_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        priority.parse_objective_class(text)


def test_one_objective_mapped_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="more than once"):
        priority.check_objective_classes((("a", "bulk"), ("a", "interactive")))


# -- through a real front ------------------------------------------------------------------------


def test_the_fairness_id_is_the_tenant_on_the_access_line() -> None:
    with Serve() as serve:
        assert serve.post(clef_body(), headers=[(FAIRNESS, "team-a"),
                                                ("X-Request-Id", "fair-1")]).status == 200
        assert serve.post(clef_body(), headers=[("X-Request-Id", "fair-2")]).status == 200
        assert serve.post(clef_body(), headers=[(FAIRNESS, "has space"),
                                                ("X-Request-Id", "fair-3")]).status == 200
        assert " tenant=team-a " in serve.wait_for(r"request .*request_id=fair-1$").group(0)
        assert " tenant=- " in serve.wait_for(r"request .*request_id=fair-2$").group(0)
        assert " tenant=- " in serve.wait_for(r"request .*request_id=fair-3$").group(0)


def test_the_fairness_id_is_a_key_of_the_json_access_line() -> None:
    with Serve(front_args=("--log-format", "json")) as serve:
        serve.post(clef_body(), headers=[(FAIRNESS, "team-b"), ("X-Request-Id", "fair-j")])
        line = serve.wait_for(r'"request_id": "fair-j".*"message": "request"|'
                              r'"message": "request".*"request_id": "fair-j"').string
    assert json.loads(line)["tenant"] == "team-b"


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    yield from http_collector()


def test_the_fairness_id_is_an_attribute_of_the_span(collector: tuple[Collector, str]) -> None:
    sink, endpoint = collector
    with Serve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}) as serve:
        serve.post(clef_body(), headers=[(FAIRNESS, "team-c"), ("X-Request-Id", "span-t")])
        serve.post(clef_body(), headers=[("X-Request-Id", "span-none")])
        spans = sink.wait_spans(_has_request("span-none", 3))
        spans = sink.wait_spans(_has_request("span-t", 3))
    assert _server_span(spans, "span-t").attributes["clef.tenant"] == "team-c"
    assert "clef.tenant" not in _server_span(spans, "span-none").attributes


def test_mapped_objectives_wait_as_their_class(tmp_path: Path) -> None:
    """`--objective-class` (the setting under test) maps the gateway's objective names; an
    unmapped objective keeps the default class; X-Clef-Priority still overrides."""
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    front = ("--objective-class", "clef-bulk=bulk", "--objective-class",
             "clef-interactive=interactive")
    # One request in flight per worker (`max_batch=1`): the rest wait in the front's queue,
    # where their classes order them.
    with Serve("--log-file", str(log), front_args=front, max_batch=1) as serve:
        running = serve.hold_in_flight(gate)
        waiting = [
            _queue(serve, "bulk", [(OBJECTIVE, "clef-bulk")]),
            _queue(serve, "overridden", [(OBJECTIVE, "clef-bulk"),
                                         ("X-Clef-Priority", "interactive")]),
            _queue(serve, "unmapped", [(OBJECTIVE, "someone-elses")]),
            _queue(serve, "interactive", [(OBJECTIVE, "clef-interactive")]),
        ]
        gate.touch()
        assert [call.result().status for call in [running, *waiting]] == [200] * 5
    assert log.read_text().split() == ["running", "overridden", "unmapped", "interactive",
                                       "bulk"]


def test_without_the_flag_objectives_are_ignored(tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    with Serve("--log-file", str(log), max_batch=1) as serve:  # the rest queue in the front
        running = serve.hold_in_flight(gate)
        waiting = [_queue(serve, "first", [(OBJECTIVE, "clef-bulk")]),
                   _queue(serve, "second", [])]
        gate.touch()
        assert [call.result().status for call in [running, *waiting]] == [200] * 3
    assert log.read_text().split() == ["running", "first", "second"]
