"""`clef-batch --input IN.jsonl --output OUT.jsonl [model flags]`: bulk scoring without HTTP.

Bulk work (an eval set, re-enriching a whole collection) sent through the server pays the FIFO,
the clients' timeouts and retries, and delays the people waiting on interactive requests. This
command runs the server's own worker on the model flags of `clef-serve` (one definition,
`clef_protocol.options`) and drives the server's own dispatch (`clef_dispatch`: the
same worker flags, supervision, liveness and resend policy), checks every body with the front's
own checks, and keeps the worker fed with full batches of similar-length requests. The output
has one line per input line, in OpenAI's batch output shape, keyed by custom_id (order differs
from the input's). An existing output is resumed. See docs/batch.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
from pathlib import Path

from clef_api.catalogue import Catalogue, served_name
from clef_api.checks import DEFAULT_BODY_LIMIT, RequestRules
from clef_api.responses import Reply
from clef_dispatch import StartupFailed, add_worker_arguments, worker_settings_from
from clef_protocol.arg_types import non_negative_float, positive_int
from clef_protocol.finetune import resolve_finetunes
from clef_protocol.options import add_model_arguments, limits_from
from clef_tools.batch_input import BadLine, InputScan, Job, read_input
from clef_tools.batch_output import OutputFile, bad_line, new_request_id
from clef_tools.batch_runner import (
    EXIT_BAD_LINES,
    EXIT_DONE,
    EXIT_GAVE_UP,
    EXIT_INTERRUPTED,
    EXIT_NOT_STARTED,
    BatchRunner,
    RunState,
)
from clef_tools.progress import Progress
from clef_tools.resume import Done, ResumeError, load_done, other_weights
from clef_tools.screening import Screen

# Worker replacements before a run gives up (a rerun resumes); the server never gives up.
DEFAULT_MAX_RESTARTS = 5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-batch",
        description="Score a JSONL file of Clef requests with the server's worker, no HTTP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    files = parser.add_argument_group("files")
    files.add_argument("--input", required=True, type=Path, metavar="IN.jsonl",
                       help='one request a line: {"custom_id": ..., "body": {...}} (optionally '
                            'with "method": "POST" and a scoring "url")')
    files.add_argument("--output", required=True, type=Path, metavar="OUT.jsonl",
                       help="answers, one a line; an existing file is resumed")
    files.add_argument("--resume-other-weights", action="store_true",
                       help="resume an output whose lines were scored by weights the workers "
                            "no longer serve (each line names its own `weights`); without it "
                            "such a resume stops before writing anything")
    add_model_arguments(parser)
    add_worker_arguments(parser, max_restarts=DEFAULT_MAX_RESTARTS)
    api = parser.add_argument_group("requests")
    api.add_argument("--served-model-name", nargs="+", type=served_name, default=None,
                     metavar="NAME",
                     help="names accepted in Workers-AI urls (default: the --variant)")
    api.add_argument("--body-limit", type=positive_int, default=DEFAULT_BODY_LIMIT,
                     help="largest body in bytes (413 above), as clef-serve's --body-limit")
    parser.add_argument("--progress-interval", type=non_negative_float, default=10.0,
                        help="seconds between progress lines when stderr is not a terminal")
    return parser


def _remaining(scan: InputScan, done: Done) -> tuple[list[Job], list[BadLine], int]:
    """The jobs and bad lines the output does not answer yet, and how many it does."""
    jobs = [job for job in scan.jobs if job.custom_id not in done.custom_ids]
    bad = [b for b in scan.bad
           if (b.custom_id not in done.custom_ids if b.custom_id is not None
               else b.line not in done.lines)]
    return jobs, bad, scan.lines - len(jobs) - len(bad)


class _ProgressHandler(logging.Handler):
    """The dispatch package's log lines (a worker lost, replaced, its stack) on stderr, through
    the progress display so they never break its bar."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.WARNING)
        self._progress = progress
        self.setFormatter(logging.Formatter("clef-batch: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self._progress.write(self.format(record))


def _log_through(progress: Progress) -> None:
    root = logging.getLogger()
    root.handlers[:] = [_ProgressHandler(progress)]
    root.setLevel(logging.WARNING)


def _other_weights(done: Done, output: Path, served: set[str]) -> str | None:
    return other_weights(done, served, output)


def _exit_status(state: RunState, bad_lines: int) -> int:
    if state.interrupted:
        return EXIT_INTERRUPTED
    if state.gave_up is not None:
        return EXIT_GAVE_UP
    return EXIT_BAD_LINES if bad_lines else EXIT_DONE


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the worker ran (reading a large input, say)
        print("clef-batch: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = worker_settings_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.input.is_file():
        parser.error(f"--input {args.input}: no such file")
    scan = read_input(args.input)
    try:
        done = load_done(args.output)
    except (ResumeError, OSError) as exc:
        print(f"clef-batch: {exc}", file=sys.stderr)
        return EXIT_NOT_STARTED
    jobs, bad, already = _remaining(scan, done)
    progress = Progress("clef-batch", scan.lines, initial=already,
                        interval=args.progress_interval)
    if done.torn_bytes:
        progress.write(f"clef-batch: dropped a torn last line ({done.torn_bytes} bytes) from "
                       f"{args.output}")
    if already:
        progress.write(f"clef-batch: resuming: {already} of {scan.lines} lines already answered "
                       f"in {args.output}")
    for item in scan.bad:
        progress.write(f"clef-batch: bad input: {item.message}")
    served = tuple(args.served_model_name or (args.variant,))
    variants = tuple(f.name for f in resolve_finetunes(args.finetune, (*served, args.variant)))
    screen = Screen(RequestRules(limits_from(args),
                                 Catalogue(served, variants=variants,
                                           finetune=bool(args.finetune)),
                                 args.body_limit))
    refused: list[tuple[Job, Reply]] = []
    forward: list[Job] = []
    for job in jobs:
        refusal = screen.refuse(job)
        if refusal is None:
            forward.append(job)
        else:
            refused.append((job, refusal))
    # Similar lengths batch together with little padding; the body's size stands in for its
    # token count (the front has no tokenizer).
    forward.sort(key=lambda job: len(job.body))
    output = OutputFile(args.output)
    _log_through(progress)

    def unscored() -> None:
        """The lines no worker scores: written once the output may take this run's lines."""
        for item in bad:
            output.write(bad_line(item))
            progress.update()
        for job, refusal in refused:
            runner.record(job, new_request_id(), refusal)

    check = None if args.resume_other_weights else functools.partial(
        _other_weights, done, args.output)
    runner = BatchRunner(forward, settings, output.write, progress.update, progress.write,
                         check_weights=check, before=unscored)
    try:
        if forward:
            state = asyncio.run(runner.run())
        else:
            unscored()
            state = runner.state
    except StartupFailed as exc:
        progress.close()
        print(f"clef-batch: the worker did not start: {exc}", file=sys.stderr)
        return EXIT_NOT_STARTED
    finally:
        output.close()
    progress.close()
    if state.other_weights is not None:
        print(f"clef-batch: {state.other_weights}", file=sys.stderr)
        return EXIT_NOT_STARTED
    statuses = ", ".join(f"{count} x {status}" for status, count in sorted(state.statuses.items()))
    print(f"clef-batch: {progress.count}/{scan.lines} lines answered in {args.output} "
          f"({statuses or 'none this run'}; {len(scan.bad)} bad input line(s); "
          f"{state.restarts} worker restart(s))", file=sys.stderr)
    if state.gave_up is not None:
        print(f"clef-batch: gave up: {state.gave_up}; rerun to resume", file=sys.stderr)
    return _exit_status(state, len(scan.bad))


if __name__ == "__main__":
    sys.exit(main())
