"""A stand-in for `python -m clef_worker` that speaks the same frame protocol, without a model.

Run by the front through `--worker-command "python tests/fake_worker.py [switches]"`; the front
appends its model flags, which are accepted and ignored. Each answer reports which process and
thread produced it and when, so tests can check serialisation, ordering and restarts. With
`--max-batch` above 1 the front sends several requests before the first is answered; they wait
on the pipe and are answered one by one in arrival order, each with its own frame.

Start-up switches: --ready-delay S, --fatal REASON, --exit-code N (exit before ready),
--fatal-once-file PATH (fatal if PATH exists, removing it), --garbage-at-start, --demo,
--replacement-ready-gate PATH (a replacement worker, started once the --crash-once-file marker
exists, waits for PATH before `ready`: tests observe the restarting state without timing),
--ready-gate PATH (every worker waits for PATH before `ready`).
Per request: --delay S (or "sleep": S in the body; "hold_until": PATH waits for that file to
exist), spent before the markers act. While it so holds a request the fake worker still reads
its pipe and answers pings (a held request stands for a live worker that a test keeps busy;
other frames read meanwhile wait their turn); with --silent-forwards it answers none until the
request is answered, as the real worker does during a forward. Markers in
the request body (the front validates first, so bodies are valid Clef requests plus these keys):
  "wedge": true     stop reading and answering, for good (a deadlock that holds its pipe open)
  "crash": true     os._exit(70) before answering (only once per --crash-once-file PATH if given)
  "cuda_error": true  answer 500, then exit with the real worker's executor-broken status (3)
  "garbage": true   write non-frame bytes on the protocol channel
  "oversize": true  write a frame header announcing 2 GiB
  "print": true     print to stdout and write to fd 1 (must not reach the channel)
  "error": "text"   answer an `error` frame, status 422 (or "error_status"); a 5xx is logged
                    through clef_worker.logs, tagged with the frame's request and trace ids
  "truncated_tokens": N   report N state tokens dropped (input_tokens is the body's length)
  "batch_size": N   report that a forward of N requests answered it
  "stages": {...}   send this as the response frame's `stages` (encode_ms, forward_ms, head_ms)
--log-format json logs as the real worker does with it.
--log-file PATH appends each received request's `tag` (one per line) before answering.
--fake-prefix-cache: `ready` reports a prefix cache (enabled as the model flag --prefix-cache
says) and each response its figures: the longest leading run of characters its state shares
with a state this process saw before, a "token" per 4 characters (no model: the front's view).
--fake-self-check: `ready` carries a passing start-up self-check verdict (the real worker's
default), so the front exports its `clef_worker_self_check_*` gauges.
--fake-prefix-cache-disagrees: as if the start-up self-check's prefixed probe had disagreed:
`ready` reports the cache turned off with the probe's reason, and nothing is reused.
--weights-file PATH: the base's weights fingerprint is PATH's text as it was at start (`ready`'s
`fingerprint` and `models`, and every response's `weights`): a test "replaces the weights" by
rewriting the file and restarting workers.
--fake-variants: serve as fine-tuned variants the checkpoints in the `--finetune` directories as
they are at start (each subdirectory holding adapter/adapter_config.json, named after it, with
the fingerprint `variant-NAME`); a request naming one is answered with its fingerprint: a test
removes a checkpoint and restarts workers.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Claim the protocol channel before anything else runs, with the real worker's own guard: stray
# prints (to sys.stdout or fd 1) then land on stderr and cannot corrupt frames.
from clef_worker.stdio import claim_channel

_CHANNEL_IN, _CHANNEL_OUT = claim_channel()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from typing import Any, BinaryIO  # noqa: E402

from clef_protocol import messages  # noqa: E402
from clef_protocol.frames import read_frame_blocking, write_frame_blocking  # noqa: E402
from clef_protocol.messages import PREFIX_CACHE_OFF_BY_FLAG  # noqa: E402
from clef_protocol.options import add_model_arguments  # noqa: E402
from clef_worker.logs import configure as configure_logs  # noqa: E402
from clef_worker.logs import enable_stack_dumps, request_context  # noqa: E402
from clef_worker.serving.batching import frame_waiting  # noqa: E402
from clef_worker.serving.policy import BatchPolicy  # noqa: E402

logger = logging.getLogger("fake_worker")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake_worker")
    add_model_arguments(parser)
    parser.add_argument("--ready-delay", type=float, default=0.0)
    parser.add_argument("--fatal", default=None)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--fatal-once-file", default=None)
    parser.add_argument("--garbage-at-start", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--crash-once-file", default=None)
    parser.add_argument("--log-file", default=None)
    parser.add_argument("--demo", action="store_true")
    parser.add_argument("--replacement-ready-gate", default=None)
    parser.add_argument("--ready-gate", default=None)
    parser.add_argument("--no-pings", action="store_true")
    parser.add_argument("--silent-forwards", action="store_true")
    parser.add_argument("--weights-file", default=None)
    # A worker of its own (a --worker-command) whose `ready` says nothing about batching.
    parser.add_argument("--no-batch-policy", action="store_true")
    parser.add_argument("--fake-prefix-cache", action="store_true")
    parser.add_argument("--fake-prefix-cache-disagrees", action="store_true")
    parser.add_argument("--fake-self-check", action="store_true")
    parser.add_argument("--fake-variants", action="store_true")
    return parser.parse_args()


def fake_variants(args: argparse.Namespace) -> dict[str, str]:
    """The checkpoints in the `--finetune` directories now, by name, with their fingerprints."""
    if not args.fake_variants:
        return {}
    found: dict[str, str] = {}
    for value in args.finetune:
        for child in sorted(Path(value).iterdir()):
            if (child / "adapter" / "adapter_config.json").is_file():
                found[child.name] = f"variant-{child.name}"
    return found


class FakePrefixCache:
    """The states this process has answered, and the figures a prefix cache would report."""

    CHARS_PER_TOKEN = 4

    DISAGREED = ("self-check: the prefixed probe differs from the eager answers by 0.2, "
                 "1 argmax mismatches")

    def __init__(self, enabled: bool, disagreed: bool = False) -> None:
        self.enabled = enabled and not disagreed
        self.reason = (self.DISAGREED if disagreed and enabled else
                       "" if enabled else PREFIX_CACHE_OFF_BY_FLAG)
        self.states: list[str] = []
        self.hits = self.lookups = self.tokens_reused = 0

    def info(self) -> messages.PrefixCacheInfo:
        return messages.PrefixCacheInfo(self.enabled, 1 << 30, 256, self.reason)

    def answer(self, state: str) -> messages.PrefixStats:
        reused = 0
        if self.enabled:
            self.lookups += 1
            shared = max((_common_chars(state, seen) for seen in self.states), default=0)
            reused = shared // self.CHARS_PER_TOKEN
            self.hits += reused > 0
            self.tokens_reused += reused
            self.states.append(state)
        return messages.PrefixStats(reused, sum(map(len, self.states)), len(self.states),
                                    self.hits, self.lookups, self.tokens_reused)


class Reader:
    """The front's frames, read in order; `hold` waits while answering pings (see above)."""

    def __init__(self, inp: BinaryIO, out: BinaryIO, silent: bool) -> None:
        self.inp, self.out, self.silent = inp, out, silent
        self.later: deque[dict[str, Any] | None] = deque()  # read during a hold: not yet served

    def next(self) -> dict[str, Any] | None:
        return self.later.popleft() if self.later else read_frame_blocking(self.inp)

    def hold(self, seconds: float, until: str | None = None) -> None:
        """Wait `seconds`, then until the file `until` exists, answering pings meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end or (until and not os.path.exists(until)):
            step = max(0.0, min(0.01, end - time.monotonic())) or 0.01
            if self.silent or (self.later and self.later[-1] is None):
                time.sleep(step)  # held in flight until the time passes or the file appears
            elif frame_waiting(self.inp, step):
                message = read_frame_blocking(self.inp)
                if message is not None and message["kind"] == messages.PING:
                    write_frame_blocking(self.out, messages.pong(message["seq"]))
                else:
                    self.later.append(message)


def _common_chars(one: str, other: str) -> int:
    """How many leading characters two strings share."""
    count = 0
    for a, b in zip(one, other, strict=False):
        if a != b:
            break
        count += 1
    return count


def answer(args: argparse.Namespace, out: BinaryIO, message: dict[str, Any],
           reader: Reader, prefix_cache: FakePrefixCache | None = None) -> None:
    request_id = message["id"]
    start_ns = time.monotonic_ns()
    request = json.loads(message["body"])
    if args.log_file:
        with open(args.log_file, "a", encoding="utf-8") as log:
            log.write(f"{request.get('tag')}\n")
    delay = float(request.get("sleep", args.delay))
    if delay or request.get("hold_until"):  # zero work costs no system call (bench_http.py)
        reader.hold(delay, request.get("hold_until"))
    while request.get("wedge"):
        time.sleep(3600)  # alive, silent, reading nothing: only a kill ends it
    if request.get("crash"):
        marker = args.crash_once_file
        if marker is None or _create_once(marker):
            os._exit(70)
    if request.get("garbage"):
        out.write(b"this is not a frame\n" * 4)
        out.flush()
        return
    if request.get("oversize"):
        out.write((2**31).to_bytes(4, "big") + b"\x81")
        out.flush()
        return
    if request.get("print"):
        print("library chatter on stdout")
        sys.stdout.flush()
        os.write(1, b"C library chatter on fd 1\n")
    worker_ms = (time.monotonic_ns() - start_ns) / 1e6
    if request.get("cuda_error"):
        write_frame_blocking(out, messages.error(request_id, 500, "inference failed", 0.0))
        os._exit(messages.EXIT_EXECUTOR_BROKEN)
    model = request.get("model")
    if "error" in request:
        status = int(request.get("error_status", 422))
        if status >= 500:
            logger.error("request %s failed: %s", request_id, request["error"])
        write_frame_blocking(out, messages.error(request_id, status, str(request["error"]),
                                                 worker_ms))
        return
    body = {
        "model": request.get("model"),
        "tag": request.get("tag"),
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "request_id": request_id,
        "bytes": len(message["body"]),
        "start_ns": start_ns,
        "end_ns": time.monotonic_ns(),
    }
    payload = json.dumps(body).encode()
    frame = messages.response(
        request_id, payload, worker_ms, input_tokens=len(message["body"]),
        truncated_tokens=int(request.get("truncated_tokens", 0)),
        batch_size=int(request.get("batch_size", 1)),
        weights=args.variants.get(str(model), args.weights),
        prefix=None if prefix_cache is None else prefix_cache.answer(str(request.get("state"))))
    if "stages" in request:
        frame["stages"] = request["stages"]
    write_frame_blocking(out, frame)


def _create_once(marker: str) -> bool:
    """Create the marker file: True for the one process that created it (O_EXCL)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _take_once(marker: str) -> bool:
    """Remove the marker file if it exists: True for the one process whose unlink succeeded
    (several workers starting together may all see the file; only one may act on it)."""
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return False
    return True


def _policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The batch policy as the real worker reports it (its flags, resolved for its device), or
    nothing with --no-batch-policy."""
    if args.no_batch_policy:
        return {}
    policy = BatchPolicy.resolve("cpu", max_batch_tokens=args.max_batch_tokens or 0,
                                 max_sequences=args.max_batch or 0)
    return policy.ready_fields()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logs()
    args = parse_args()
    configure_logs(log_format=args.log_format)
    enable_stack_dumps()  # as the real worker: a hung one says where it was stuck
    out, inp = _CHANNEL_OUT, _CHANNEL_IN
    args.weights = (Path(args.weights_file).read_text(encoding="utf-8").strip()
                    if args.weights_file else "")
    args.variants = fake_variants(args)
    time.sleep(args.ready_delay)
    while args.ready_gate and not os.path.exists(args.ready_gate):
        time.sleep(0.01)  # held before `ready` until the test opens the gate
    gate = args.replacement_ready_gate
    if gate and args.crash_once_file and os.path.exists(args.crash_once_file):
        while not os.path.exists(gate):
            time.sleep(0.01)  # held before `ready` until the test opens the gate
    if args.exit_code is not None:
        print(f"fake worker: exiting with {args.exit_code} before ready", file=sys.stderr)
        return args.exit_code
    if args.fatal is not None:
        write_frame_blocking(out, messages.fatal(args.fatal))
        return 1
    if args.fatal_once_file is not None and _take_once(args.fatal_once_file):
        write_frame_blocking(out, messages.fatal("GPU still held by the previous worker"))
        return 1
    if args.garbage_at_start:
        out.write(b"Loading checkpoint shards: 100%\n")
        out.flush()
        time.sleep(60)  # a confused worker that does not exit: the front must not wait for it
        return 0
    prefix_cache = (FakePrefixCache(args.prefix_cache == "on", args.fake_prefix_cache_disagrees)
                    if args.fake_prefix_cache or args.fake_prefix_cache_disagrees else None)
    write_frame_blocking(out, messages.ready(messages.ReadyInfo(
        pid=os.getpid(), thread=threading.current_thread().name, model="fake",
        variant=args.variant, device="cpu", dtype="float32", gdn_path="none", warmup_ms=0.0,
        versions={"fake_worker": "1"}, demo=args.demo, snapshot="", pings=not args.no_pings,
        prefix_cache=None if prefix_cache is None else prefix_cache.info(),
        self_check=messages.SelfCheck(True, "per-group", 2, 0.0, [], mode="on", bound=1e-4,
                                      ms=1.0) if args.fake_self_check else None,
        fingerprint=args.weights,
        models={**({args.variant: args.weights} if args.weights else {}), **args.variants},
        finetunes=[{"name": name} for name in args.variants],
        **_policy_fields(args),
    )))
    reader = Reader(inp, out, args.silent_forwards)
    while True:
        message = reader.next()
        if message is None or message["kind"] == messages.SHUTDOWN:
            return 0
        if message["kind"] == messages.PING:
            write_frame_blocking(out, messages.pong(message["seq"]))
            continue
        with request_context(message.get("request_id"), message.get("trace_id")):
            answer(args, out, message, reader, prefix_cache)


if __name__ == "__main__":
    sys.exit(main())
