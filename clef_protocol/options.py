"""Model and request-limit flags, defined once and shared by `clef-serve` and `clef_worker`.

The front parses them, then hands the same values to the worker command line via `worker_argv`,
which walks the same definitions (`add_model_arguments`), so a flag added here reaches both
processes without a second definition. The choices of every mode flag, the device grammar and
the per-device batch-token budgets live here too, so the help text, the front and the worker
read one copy.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from clef_protocol.arg_types import non_negative_float, non_negative_int, positive_int
from clef_protocol.finetune import finetune_arg
from clef_protocol.logfmt import LOG_FORMATS

VARIANTS = ("clef-flash", "clef")
DEVICES_HELP = "auto, cpu, cuda or cuda:N"
DTYPES = ("auto", "bfloat16", "float32")
GDN_PATHS = ("auto", "fla", "torch")
SHORT_CONV_MODES = ("auto", "fla", "torch")
EXECUTORS = ("native", "release")
CUDA_GRAPH_MODES = ("auto", "on", "off")
MEDIA_MODES = ("auto", "on", "off")
# How a batched forward lays its requests out (clef_worker.serving.policy): `packed` puts the
# requests' tokens end to end in one sequence with cumulative offsets (no padding), `padded`
# right-pads
# every request to the group's bucket in a [rows, tokens] batch.
BATCH_LAYOUTS = ("auto", "packed", "padded")
# The worker's start-up self-check (clef_worker.starting.self_check): `on` falls back to a slower
# layout that agrees with the eager answers, `strict` refuses to start instead, `report` compares
# and
# records but always serves the layout asked for (a benchmark measuring that layout), `off`
# skips it. `on` and `strict` keep a passing verdict for the next start on the same weights,
# code, device, dtype and layout (clef_worker.starting.verdict_store); `report` always runs the
# check.
SELF_CHECK_MODES = ("on", "strict", "report", "off")
# The worker's prefix cache (clef_worker.serving.prefix.cache): a request whose leading tokens were
# read before runs only the rest.
PREFIX_CACHE_MODES = ("on", "off")


# `--max-batch-tokens 0`: tokens per batched forward by device (real tokens when packed, rows x
# bucket length when padded). On CPU a forward of about eight ~500-token rows measured best:
# beyond that, throughput stays flat while every request in the forward waits for all of them
# (docs/benchmarks.md).
DEFAULT_MAX_BATCH_TOKENS = 16384
DEFAULT_MAX_BATCH_TOKENS_CPU = 4096
# `--max-batch 0`: requests per forward, and the requests the front keeps in flight to one
# worker (it reads the worker's figure from `ready`). The worker builds its graph shapes for it.
DEFAULT_MAX_BATCH_CUDA = 16
DEFAULT_MAX_BATCH_CPU = 8
# `--prefix-cache-bytes auto`: the prefix cache's bound by device. On CUDA it is device memory
# beside the weights and graphs (Clef-Flash keeps about 40 KiB per cached token plus about 49 MiB of
# Gated DeltaNet state per cached point: docs/operations.md); on CPU, host memory.
DEFAULT_PREFIX_CACHE_BYTES_CUDA = 16 * 1024**3
DEFAULT_PREFIX_CACHE_BYTES_CPU = 1024**3
# `--prefix-cache-bytes auto` (the default) is that bound; 0 is what a byte bound of 0 reads as:
# no room, the cache off (its `disabled_reason` says so, and no alert fires for it).
AUTO = "auto"


def prefix_cache_bytes(value: str) -> int | str:
    """argparse type of `--prefix-cache-bytes`: `auto` or a number of bytes (0: off)."""
    if value.strip() == AUTO:
        return AUTO
    try:
        return non_negative_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected {AUTO} or a non-negative number of bytes, got {value!r}") from None


def prefix_cache_capacity(value: int | str, device: str) -> int:
    """The bound a `--prefix-cache-bytes` value means on `device` (`auto`: by device)."""
    if value == AUTO:
        return (DEFAULT_PREFIX_CACHE_BYTES_CUDA if device.startswith("cuda")
                else DEFAULT_PREFIX_CACHE_BYTES_CPU)
    return int(value)


@dataclass(frozen=True)
class Device:
    """A parsed device: `auto`, `cpu`, `cuda` (the current CUDA device) or `cuda:N`."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def parse_device(text: str) -> Device:
    """The device grammar, parsed in one place; ValueError names what was expected."""
    if text in ("auto", "cpu", "cuda"):
        return Device(text)
    kind, colon, index = text.partition(":")
    if kind == "cuda" and colon and index.isdigit() and index.isascii():
        return Device("cuda", int(index))
    raise ValueError(f"invalid device {text!r}: expected {DEVICES_HELP}")


@dataclass(frozen=True)
class RequestLimits:
    """Caps a request must respect before it may reach the model."""

    max_length: int = 16384
    max_questions: int = 64
    max_choice_options: int = 255
    max_score_levels: int = 10
    # Media (clef_protocol.media): off refuses every image and video with a 422.
    media: bool = True
    max_images: int = 4
    max_video_frames: int = 32
    max_image_pixels: int = 4096 * 4096


def device_arg(value: str) -> str:
    """argparse type: a device of the grammar above, in its canonical spelling."""
    try:
        return str(parse_device(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that choose and shape the model; the worker receives all of them."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default="demo",
                       help="snapshot directory, or 'demo' for the built-in tiny random snapshot")
    group.add_argument("--variant", choices=VARIANTS, default="clef-flash",
                       help="which release the snapshot must be (checked against its shapes)")
    group.add_argument("--finetune", action="append", type=finetune_arg, default=[],
                       metavar="NAME=CHECKPOINT",
                       help="serve a clef-finetune checkpoint (LoRA adapter + head) unmerged "
                            "over --model as model NAME; or a directory of checkpoints, each "
                            "named after its directory (repeatable; docs/finetune.md)")
    group.add_argument("--device", type=device_arg, default="auto", help=DEVICES_HELP)
    group.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="auto: bfloat16 on CUDA, float32 on CPU")
    group.add_argument("--gdn-prefill", choices=GDN_PATHS, default="auto",
                       help="Gated DeltaNet prefill kernel: fla (CUDA only) or torch")
    group.add_argument("--short-conv", choices=SHORT_CONV_MODES, default="auto",
                       help="Gated DeltaNet short convolution: fla (its Triton kernel; CUDA with "
                            "--gdn-prefill fla) or torch (auto: fla wherever it can run)")
    group.add_argument("--executor", choices=EXECUTORS, default="native",
                       help="native (this project's code) or release (runs the snapshot's own "
                            "joint_schema_model.py: only for snapshots you trust)")
    group.add_argument("--cuda-graphs", choices=CUDA_GRAPH_MODES, default="auto",
                       help="replay forwards as CUDA graphs captured at warm-up, one per "
                            "shape (packed: total-token buckets; padded: [rows, length "
                            "bucket]); auto: on for CUDA; on a CPU device, on runs the shapes "
                            "eagerly")
    group.add_argument("--graph-max-length", type=non_negative_int, default=0,
                       help="largest bucket captured; longer requests run eagerly "
                            "(0: up to --max-length)")
    group.add_argument("--batch-layout", choices=BATCH_LAYOUTS, default="auto",
                       help="how a batched forward holds its requests: packed (tokens end to "
                            "end with offsets, no padding; one CUDA graph per total-token "
                            "bucket) or padded (rows right-padded to a length bucket; graphs "
                            "per [rows, bucket]). auto: on CPU each group padded when its "
                            "lengths are uniform enough that padding wastes little, else packed, "
                            "whichever measured faster (docs/benchmarks.md); on CUDA packed "
                            "where its kernels can be "
                            "captured (bfloat16 with fla), else padded, until the GPU script's "
                            "packed-vs-padded step (bench/gpu_session.sh) has measured both")
    group.add_argument("--max-batch-tokens", type=non_negative_int, default=0,
                       help="tokens per batched forward: real tokens when packed (each aligned "
                            "to 64 with CUDA graphs), requests x bucket length when padded "
                            f"(0: by device, {DEFAULT_MAX_BATCH_TOKENS} on CUDA, "
                            f"{DEFAULT_MAX_BATCH_TOKENS_CPU} on CPU)")
    group.add_argument("--max-batch", type=non_negative_int, default=0,
                       help="requests per forward, and requests the front keeps in flight to one "
                            "worker (the worker reports it in `ready`; 0: by device, "
                            f"{DEFAULT_MAX_BATCH_CUDA} on CUDA, {DEFAULT_MAX_BATCH_CPU} on CPU)")
    group.add_argument("--batch-window-ms", type=non_negative_float, default=0.0,
                       help="how long the worker waits for more requests before a forward")
    group.add_argument("--self-check", choices=SELF_CHECK_MODES, default="on",
                       help="at start-up, answer a fixed set of requests through the serving "
                            "layout and one by one eagerly, and compare: on (on a mismatch, log "
                            "an ERROR and fall back to a slower layout that agrees), strict "
                            "(refuse to start instead), report (compare and record, never fall "
                            "back, never reuse a kept verdict: for benchmarks) or off (skip); "
                            "on and strict keep a passing verdict and skip the check while the "
                            "weights, code, device, dtype and layout stay the same")
    group.add_argument("--prefix-cache", choices=PREFIX_CACHE_MODES, default="on",
                       help="keep each request's per-layer states at every block of its leading "
                            "tokens, so a later request that begins with the same tokens (same "
                            "variant, same media) runs only the rest: on or off")
    group.add_argument("--prefix-cache-bytes", type=prefix_cache_bytes, default=AUTO,
                       help="the prefix cache's bound in bytes, least recently used out first "
                            f"({AUTO}, the default: by device, "
                            f"{DEFAULT_PREFIX_CACHE_BYTES_CUDA // 1024**3} GiB of device memory "
                            f"on CUDA, {DEFAULT_PREFIX_CACHE_BYTES_CPU // 1024**3} GiB on CPU; 0: "
                            "no bytes, the cache is off as with --prefix-cache off)")
    limits = parser.add_argument_group("request limits")
    limits.add_argument("--max-length", type=positive_int, default=RequestLimits.max_length,
                        help="token budget per request (state is cut to fit)")
    limits.add_argument("--max-questions", type=positive_int, default=RequestLimits.max_questions,
                        help="questions per request")
    limits.add_argument("--max-options", type=positive_int,
                        default=RequestLimits.max_choice_options,
                        help="options per choice question")
    limits.add_argument("--max-levels", type=positive_int, default=RequestLimits.max_score_levels,
                        help="levels per score question")
    limits.add_argument("--media", choices=MEDIA_MODES, default="auto",
                        help="images and videos: auto (on when the snapshot has a vision tower "
                             "and a processor), on (refuse to start without them) or off (422)")
    limits.add_argument("--max-images", type=positive_int, default=RequestLimits.max_images,
                        help="images per request")
    limits.add_argument("--max-video-frames", type=positive_int,
                        default=RequestLimits.max_video_frames,
                        help="video frames per request, all videos together")
    limits.add_argument("--max-image-pixels", type=positive_int,
                        default=RequestLimits.max_image_pixels,
                        help="width x height of one image or frame, checked in its header "
                             "before decoding")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="stderr lines of the front and the workers: text (key=value) or "
                             "json (one object per line)")


def limits_from(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_length=args.max_length,
        max_questions=args.max_questions,
        max_choice_options=args.max_options,
        max_score_levels=args.max_levels,
        media=args.media != "off",
        max_images=args.max_images,
        max_video_frames=args.max_video_frames,
        max_image_pixels=args.max_image_pixels,
    )


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The model and limit flags as worker command-line arguments, read off the flag table.

    Every flag `add_model_arguments` defines is passed with its parsed value, spelled so the
    same definitions parse it back to that value (a float by `repr`, which round-trips).
    """
    table = argparse.ArgumentParser(add_help=False)
    add_model_arguments(table)
    argv: list[str] = []
    for action in table._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if isinstance(value, list):  # a repeatable flag: once per value
            argv += [item for each in value for item in (action.option_strings[0], each)]
            continue
        argv += [action.option_strings[0], repr(value) if isinstance(value, float) else str(value)]
    return argv
