"""`clef-batch`: golden answers as the server gives them, resume after SIGKILL, bad lines.

The real worker runs on the shared tiny fixture (CPU); the worker-failure and SIGINT cases use
tests/fake_worker.py, whose markers crash or hold a request on demand. Waiting is on output
lines and stderr lines, each with a bound, never on a sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from benchlib.golden import answered, assert_response_matches, refused
from clef_api.checks import RequestRules
from clef_api.responses import Reply
from clef_protocol.options import RequestLimits
from clef_tools.batch_input import BadLine, Job, parse_line, read_input
from clef_tools.batch_output import answered_line
from clef_tools.resume import ResumeError, load_done
from clef_tools.screening import Screen
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import FAKE_WORKER, REPO, clef_request

WAIT = 240.0  # the real worker loads and warms up on a busy 2-core machine within this
TINY = ("--model", str(TINY_SNAPSHOT), "--device", "cpu")
# The golden cases run with the default token budget (two cases need their own budget).
DEFAULT_BUDGET = RequestLimits().max_length
ANSWERED = [c for c in answered() if c["max_length"] == DEFAULT_BUDGET]
REFUSED = [c for c in refused() if c["max_length"] == DEFAULT_BUDGET]
WORKERS_AI = "/accounts/acct/ai/run/@cf/cloudflare/clef-flash"


class Batch:
    """One `python -m clef_tools.batch` process; stderr is read by a thread for waiting."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "clef_tools.batch", *args], cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    @property
    def stderr(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if match := regex.search(line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    raise AssertionError(f"no stderr line matching {pattern!r}:\n{self.stderr}")
                self._changed.wait(min(left, 0.5))

    def finish(self, timeout: float = WAIT) -> int:
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self._reader.join(10)
        return code


def run_batch(*args: str) -> tuple[int, str]:
    batch = Batch(*args)
    code = batch.finish()
    return code, batch.stderr


def write_jsonl(path: Path, records: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records), encoding="utf-8")


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def by_id(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ids = Counter(r["custom_id"] for r in records if r["custom_id"] is not None)
    assert max(ids.values(), default=1) == 1, ids.most_common(3)
    return {r["custom_id"]: r for r in records if r["custom_id"] is not None}


def output_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_until(condition: Any, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # polling interval, not a synchronisation guess


def pid_exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (not reaped by its dead parent yet) has exited too.
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


# -- with the real worker ---------------------------------------------------------------------


def test_golden_answers_and_refusals_like_the_server(tmp_path: Path) -> None:
    """Every golden case (default budget) as the HTTP API answers it, plus the Workers-AI
    route, the front's own refusals, and malformed lines reported with their line numbers."""
    records: list[Any] = [{"custom_id": c["name"], "body": c["request"]} for c in ANSWERED]
    records += [{"custom_id": c["name"], "method": "POST", "url": "/v1/systemone",
                 "body": c["request"]} for c in REFUSED]
    invoice = ANSWERED[0]
    records += [
        {"custom_id": "wai", "method": "POST", "url": WORKERS_AI, "body": invoice["request"]},
        {"custom_id": "wai-unknown", "method": "POST",
         "url": "/accounts/acct/ai/run/@cf/cloudflare/other", "body": invoice["request"]},
        '{"custom_id": "dup-keys", "body": {"model": "m", "model": "n", "state": "s"}}',
        {"custom_id": "not-object", "body": [1, 2]},
    ]
    first_bad = len(records) + 1
    records += [
        "this is not json",
        {"body": invoice["request"]},
        {"custom_id": invoice["name"], "body": invoice["request"]},
        {"custom_id": "health", "method": "GET", "url": "/health", "body": {}},
        {"custom_id": "elsewhere", "url": "/v1/chat/completions", "body": {}},
    ]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, records)
    code, stderr = run_batch("--input", str(source), "--output", str(out), *TINY)
    assert code == 1, stderr  # finished, with bad input lines
    assert re.search(r"every request answered \(\d+ this run, forwards of [\d.]+ requests",
                     stderr), stderr
    output = read_output(out)
    assert len(output) == len(records)  # one answer for every line: nothing lost
    got = by_id(output)
    for case in ANSWERED:
        response = got[case["name"]]["response"]
        assert response["status_code"] == 200, response
        assert_response_matches(response["body"], case["response"])
        assert response["request_id"] == got[case["name"]]["id"]
    for case in REFUSED:
        assert got[case["name"]]["response"] == {
            "status_code": 422, "request_id": got[case["name"]]["id"],
            "body": {"detail": case["error"]["message"]}}
    wai = got["wai"]["response"]
    assert wai["status_code"] == 200 and wai["body"]["success"] is True
    assert_response_matches(wai["body"]["result"], invoice["response"])
    unknown = got["wai-unknown"]["response"]
    assert unknown["status_code"] == 404 and unknown["body"]["success"] is False
    assert unknown["body"]["errors"][0]["message"].startswith("unknown model '@cf/cloudflare/")
    assert got["dup-keys"]["response"]["status_code"] == 400
    assert got["dup-keys"]["response"]["body"] == {"detail": "duplicate JSON keys are not "
                                                             "supported"}
    assert got["not-object"]["response"]["body"] == {"detail": "request must be a JSON object"}
    assert got["not-object"]["response"]["status_code"] == 400
    # The malformed lines: reported on stderr and recorded in the output, by line number.
    bad = {r["error"]["line"]: r for r in output if r["error"] is not None}
    assert sorted(bad) == list(range(first_bad, first_bad + 5))
    expected = {first_bad: ("invalid_json", None), first_bad + 1: ("missing_custom_id", None),
                first_bad + 2: ("duplicate_custom_id", None),
                first_bad + 3: ("invalid_method", "health"),
                first_bad + 4: ("invalid_url", "elsewhere")}
    for line, (code_name, custom_id) in expected.items():
        assert (bad[line]["error"]["code"], bad[line]["custom_id"]) == (code_name, custom_id)
        assert bad[line]["response"] is None
        assert f"bad input: line {line}: " in stderr
    assert "first on line 1" in bad[first_bad + 2]["error"]["message"]


def test_sigkill_then_resume_answers_every_line_once(tmp_path: Path) -> None:
    """Killed mid-run (SIGKILL: no clean-up at all), then run again with a torn last line
    added: every custom_id is answered exactly once, and every answer is a real one."""
    requests = [c["request"] for c in ANSWERED if c["name"] in
                ("invoice", "null_state", "object_state", "choice_single_option")]
    records = [{"custom_id": f"r{i:04d}", "body": requests[i % len(requests)]}
               for i in range(120)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, records)
    args = ("--input", str(source), "--output", str(out), *TINY, "--max-batch", "2")
    first = Batch(*args)
    try:
        worker_pid = int(first.wait_for(r"worker ready \(pid (\d+)")[1])
        wait_until(lambda: output_lines(out) >= 10, "10 answers before the kill")
        first.process.send_signal(signal.SIGKILL)
        assert first.finish() == -signal.SIGKILL
    finally:
        if first.process.poll() is None:
            first.process.kill()
    answered_before = output_lines(out)
    assert answered_before < len(records), "the run finished before it could be killed"
    # The orphaned worker sees its input close and exits by itself (no process left behind).
    wait_until(lambda: pid_exited(worker_pid), "the orphaned worker to exit", timeout=60)
    with out.open("ab") as stream:  # what a write cut short by a crash leaves behind
        stream.write(b'{"id": "batch_req_x", "custom_id": "r00')
    code, stderr = run_batch(*args)
    assert code == 0, stderr
    assert "dropped a torn last line" in stderr
    assert re.search(rf"resuming: {answered_before} of {len(records)} lines", stderr), stderr
    got = by_id(read_output(out))
    assert sorted(got) == sorted(r["custom_id"] for r in records)
    for record in records:
        response = got[record["custom_id"]]["response"]
        assert response["status_code"] == 200
        want = next(c for c in ANSWERED if c["request"] == record["body"])
        assert_response_matches(response["body"], want["response"])
    # A third run finds nothing left to do and changes nothing.
    before = out.read_bytes()
    code, stderr = run_batch(*args)
    assert code == 0 and out.read_bytes() == before, stderr


# -- with the fake worker (failures and signals on demand) ------------------------------------


def fake_worker(*switches: str) -> tuple[str, str]:
    return "--worker-command", shlex.join([sys.executable, str(FAKE_WORKER), *switches])


def test_a_request_that_crashes_the_worker_fails_alone(tmp_path: Path) -> None:
    """The requests lost with a crashed worker are rerun one at a time: the one that crashes
    it again gets the API's 500, the others their answers."""
    # The poison is the shortest body, so it is sent first, in the first batch of four.
    records = [{"custom_id": f"ok{i}", "body": clef_request(tag=f"request-number-{i}")}
               for i in range(8)]
    records.insert(3, {"custom_id": "poison", "body": clef_request(crash=True)})
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, records)
    code, stderr = run_batch("--input", str(source), "--output", str(out), "--max-batch", "4",
                             *fake_worker())
    assert code == 0, stderr
    got = by_id(read_output(out))
    assert got["poison"]["response"]["status_code"] == 500
    assert got["poison"]["response"]["body"] == {"detail": "inference failed"}
    for i in range(8):
        assert got[f"ok{i}"]["response"]["status_code"] == 200
    # The lost requests are rerun one at a time in the order their failures arrived: a worker
    # is replaced after the poison's second crash only if work is still left then (two
    # restarts), not when the poison was the last to run (one). Never more.
    restarts = re.search(r"(\d+) worker restart\(s\)", stderr)
    assert restarts is not None, stderr
    assert int(restarts.group(1)) in (1, 2), stderr


def test_every_line_names_its_weights_and_a_resume_under_other_weights_stops(
        tmp_path: Path) -> None:
    """Each answer names the weights that scored it (null where none did); a rerun whose
    workers serve other weights (the model replaced between runs) appends nothing unless told
    to, and then each line keeps its own."""
    old, new = "a" * 64, "b" * 64
    weights = tmp_path / "weights"
    weights.write_text(old)
    records: list[Any] = [{"custom_id": f"r{i}", "body": clef_request(tag=f"r{i}")}
                          for i in range(3)]
    records.append("not json")
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, records)
    args = ("--input", str(source), "--output", str(out),
            *fake_worker("--weights-file", str(weights)))
    code, stderr = run_batch(*args)
    assert code == 1, stderr  # one bad line
    first = read_output(out)
    assert sorted(r["weights"] for r in first if r["custom_id"]) == [old] * 3
    assert [r["weights"] for r in first if r["custom_id"] is None] == [None]

    write_jsonl(source, [*records, {"custom_id": "r3", "body": clef_request(tag="r3")}])
    weights.write_text(new)
    before = out.read_bytes()
    code, stderr = run_batch(*args)
    assert code == 2, stderr
    assert f"holds answers scored by other weights ({old[:16]}" in stderr, stderr
    assert "--resume-other-weights" in stderr and out.read_bytes() == before

    code, stderr = run_batch(*args, "--resume-other-weights")
    assert code == 1, stderr  # answered, with the input's one bad line
    got = by_id(read_output(out))
    assert {name: got[name]["weights"] for name in ("r0", "r3")} == {"r0": old, "r3": new}


def test_sigint_finishes_the_requests_in_flight_then_resumes(tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "received.log"
    records: list[dict[str, Any]] = [
        {"custom_id": f"q{i}", "body": clef_request(tag=f"q{i}", hold_until=str(gate))}
        for i in range(10)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, records)
    args = ("--input", str(source), "--output", str(out), "--max-batch", "2")
    batch = Batch(*args, *fake_worker("--log-file", str(log)))
    try:
        # The fake worker logs a request when it reads it; the second one waits on its pipe.
        wait_until(lambda: log.exists() and log.read_text().count("\n") >= 1,
                   "the requests in flight")
        batch.process.send_signal(signal.SIGINT)
        batch.wait_for("interrupted; finishing the requests in flight")
        gate.touch()  # the held requests may finish now
        assert batch.finish() == 130, batch.stderr
    finally:
        if batch.process.poll() is None:
            batch.process.kill()
    first = read_output(out)
    assert len(first) == 2 and all(r["response"]["status_code"] == 200 for r in first)
    code, stderr = run_batch(*args, *fake_worker())
    assert code == 0, stderr
    assert sorted(by_id(read_output(out))) == sorted(r["custom_id"] for r in records)


def test_a_wedged_worker_is_replaced_and_its_lines_sent_again(tmp_path: Path) -> None:
    """SIGSTOP the worker mid-run: with `--stall-timeout 5` (the subject; the default is 30 s)
    the run notices within seconds, logs the worker's stack, replaces it and sends its lines
    again; it finishes well within 60 s of the stop, every line answered exactly once, 200."""
    records = [{"custom_id": f"s{i:04d}", "body": clef_request(tag=f"line-{i}")}
               for i in range(1500)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, records)
    # 5 ms a request keeps the run going long enough to stop it halfway (the fake worker answers
    # one request at a time: about 8 s of work in all).
    batch = Batch("--input", str(source), "--output", str(out), "--stall-timeout", "5",
                  *fake_worker("--delay", "0.005"))
    stopped_pid = 0
    try:
        stopped_pid = int(batch.wait_for(r"worker ready \(pid (\d+)")[1])
        wait_until(lambda: output_lines(out) >= 300, "300 answers before the stop")
        os.kill(stopped_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert output_lines(out) < len(records), "the run finished before the worker stopped"
        code = batch.finish(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        if batch.process.poll() is None:
            batch.process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped_pid, signal.SIGCONT)
    assert code == 0, batch.stderr
    assert took < 60, took
    got = by_id(read_output(out))  # by_id fails on a line answered twice
    assert sorted(got) == [r["custom_id"] for r in records]
    assert {r["response"]["status_code"] for r in got.values()} == {200}
    stderr = batch.stderr
    assert re.search(rf"worker pid={stopped_pid} failed .*no pong and no reply within 5s.*"
                     r"reason=stalled", stderr), stderr
    assert re.search(r"[1-9]\d* worker restart\(s\)", stderr), stderr
    # Where it was stuck, before it was replaced: the worker's stack, asked for before the kill.
    assert f"worker pid={stopped_pid} is stuck" in stderr
    ready = stderr.index(f"worker ready (pid {stopped_pid},")
    failed = stderr.index(f"worker pid={stopped_pid} failed")
    stack = stderr.index("most recent call first", ready)
    assert stack < failed and "fake_worker.py" in stderr[stack:failed]


# -- the pieces, without a worker --------------------------------------------------------------


def test_parse_line_shapes() -> None:
    body = clef_request()
    plain = parse_line(1, json.dumps({"custom_id": "a", "body": body}).encode())
    assert isinstance(plain, Job) and plain.target == b"/v1/systemone"
    assert json.loads(plain.body) == body and plain.body_error is None
    openai = parse_line(2, json.dumps({"custom_id": "b", "method": "POST", "url": WORKERS_AI,
                                       "body": body}).encode())
    assert isinstance(openai, Job) and openai.target == WORKERS_AI.encode()
    for raw, code in [(b"[1]", "invalid_line"), (b'{"custom_id": 5, "body": {}}',
                                                 "missing_custom_id"),
                      (b'{"custom_id": "c"}', "missing_body"),
                      (b'{"custom_id": "c", "url": "/v1/systemone?x=1", "body": {}}',
                       "invalid_url"),
                      (b'{"custom_id": "c", "body": {}', "invalid_json")]:
        bad = parse_line(7, raw)
        assert isinstance(bad, BadLine) and bad.code == code, (raw, bad)
        assert bad.message.startswith("line 7: ")
    non_finite = parse_line(3, b'{"custom_id": "d", "body": {"model": "m", "x": NaN}}')
    assert isinstance(non_finite, Job)
    assert non_finite.body_error == "non-finite JSON numbers are not supported"


def test_read_input_skips_blank_lines_and_numbers_the_rest(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"custom_id": "a", "body": {}}\n\n  \n{"custom_id": "a", "body": {}}\n'
                       b'{"custom_id": "b", "body": {}}')
    scan = read_input(source)
    assert [(j.line, j.custom_id) for j in scan.jobs] == [(1, "a"), (5, "b")]
    assert [(b.line, b.code) for b in scan.bad] == [(4, "duplicate_custom_id")]


def test_screening_refuses_as_the_front_does() -> None:
    from clef_api.catalogue import Catalogue

    rules = RequestRules(RequestLimits(), Catalogue(("clef-flash",)), body_limit=100)
    screen = Screen(rules)
    body = json.dumps(clef_request()).encode()
    assert screen.refuse(Job(1, "a", b"/v1/systemone", body)) is None
    too_big = Job(1, "a", b"/v1/systemone", body + b" " * 100)
    refused_big = screen.refuse(too_big)
    assert refused_big is not None and refused_big.status == 413
    invalid = json.dumps({"model": "m", "state": "s", "questions": {}}).encode()
    refusal = screen.refuse(Job(1, "a", b"/v1/systemone", invalid))
    front = rules.check_body(b"/v1/systemone", invalid)  # the stage the front's pipeline runs
    assert refusal is not None and isinstance(front, Reply)
    assert (refusal.status, refusal.body) == (front.status, front.body) == (
        422, b'{"detail": "at least one question is required"}')


def test_resume_drops_only_a_torn_last_line(tmp_path: Path) -> None:
    from clef_api.responses import Reply

    out = tmp_path / "out.jsonl"
    whole = answered_line("a", "batch_req_1", Reply(200, b'{"k":1}'))
    assert json.loads(whole)["response"]["body"] == {"k": 1}
    bad = (b'{"id": "x", "custom_id": null, "response": null, "error": {"code": "invalid_json",'
           b' "message": "line 2: ...", "line": 2}}\n')
    out.write_bytes(whole + bad + b'{"id": "batch_req_2", "cus')
    done = load_done(out)
    assert done.custom_ids == {"a"} and done.lines == {2} and done.torn_bytes > 0
    assert out.read_bytes() == whole + bad
    out.write_bytes(whole + b"garbage\n")
    with pytest.raises(ResumeError, match="line 2"):
        load_done(out)
