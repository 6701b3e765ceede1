"""A clef-serve worker whose model is the in-memory Clef-Flash-shaped one (benchlib.flash_model).

For measuring the whole server over HTTP at the release's shapes where no real weights exist:
`clef-serve --worker-command "python -m benchlib.flash_worker --shape flash" ...`. The front
appends its model flags as usual (`--device`, `--cuda-graphs`, `--max-length`, ...); everything
after this module's own flags is the real worker's (`clef_worker.main`), which then loads,
warms up, captures and serves as in production, with the snapshot's tensors replaced by the
random in-memory ones. Its log says `built flash-shaped stack ...` once the model is built, which
the benchmarks wait for before trusting a number.
"""

from __future__ import annotations

import argparse
import sys

from benchlib.flash_model import SHAPES, InMemoryModel, install


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchlib.flash_worker", add_help=False)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="flash")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    own, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    install(InMemoryModel(own.shape, own.layers))
    from clef_worker.main import main as worker_main

    return worker_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
