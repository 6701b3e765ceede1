"""Time an image request on CPU, and the costs that decide where images are decoded.

Not a test: it measures, and prints Markdown for docs/benchmarks.md (section "Media"):

1. per 512x512 image (the size clients send), JPEG and PNG of a photo-like picture: the header
   check the front runs (`check_media`), the full Pillow decode, the torch pixel pipeline
   (resize, normalise, patchify), and what moving the decoded pixels instead of the encoded
   bytes to the worker would cost (msgpack pack + unpack of both);
2. one image request through `NativeExecutor.score(profile=True)` on the shared tiny snapshot,
   split into media (decode + pixels), encode, backbone (vision tower + text stack) and head,
   next to the same request without the image.

    .venv/bin/python bench/bench_media.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.paths import TINY_SNAPSHOT
from benchlib.timing import median_ms


def _round_trip(value: dict[str, bytes]) -> Any:
    """One msgpack encode and decode, as a frame on the worker pipe costs."""
    import msgpack

    return msgpack.unpackb(msgpack.packb(value))


def photo(size: int) -> Any:
    import numpy as np

    from clef_protocol.media import gradient_image

    noise = np.random.default_rng(0).integers(0, 48, (size, size, 3), dtype=np.uint8)
    return (gradient_image(size, size) // 2 + noise).astype(np.uint8)


def encode(pixels: Any, fmt: str) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, quality=90)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (bench/README.md): 2 repeats; it never writes files")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 2

    import torch

    from clef_protocol.media import check_media, decode_media
    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot
    from clef_worker.media.pixels import PixelSettings, image_patches
    from clef_worker.starting.warmup import REPRESENTATIVE as WARMUP_REQUEST

    torch.set_num_threads(max(1, torch.get_num_threads()))
    limits = RequestLimits()
    settings = PixelSettings.from_file(TINY_SNAPSHOT / "processor_config.json")
    pixels = photo(512)
    print(f"torch threads {torch.get_num_threads()}; repeat {args.repeat}; medians in ms\n")
    print("| 512x512 | bytes (base64) | header check | decode (Pillow) | pixels (torch) | "
          "pipe: encoded | pipe: decoded |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fmt in ("JPEG", "PNG"):
        data = encode(pixels, fmt)
        request = {**WARMUP_REQUEST, "images": [data]}
        decoded = decode_media(request, limits).images[0]
        raw = decoded.tobytes()
        header = median_ms(functools.partial(check_media, request, limits), args.repeat)
        decode = median_ms(functools.partial(decode_media, request, limits), args.repeat)
        patch = median_ms(functools.partial(image_patches, decoded, settings), args.repeat)
        pipe_encoded = median_ms(functools.partial(_round_trip, {"body": data.encode()}),
                                 args.repeat)
        pipe_decoded = median_ms(functools.partial(_round_trip, {"pixels": raw}), args.repeat)
        print(f"| {fmt} | {len(data):,} | {header:.2f} | {decode:.2f} | {patch:.2f} | "
              f"{pipe_encoded:.3f} | {pipe_decoded:.3f} |")

    executor = assemble_snapshot(TINY_SNAPSHOT, device="cpu", dtype="float32", limits=limits)
    executor.warm_up()
    print("\n| request (clef-tiny, CPU) | tokens | media | encode | backbone | head | total |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, request in (("text only", dict(WARMUP_REQUEST)),
                          ("+ one 512x512 JPEG", {**WARMUP_REQUEST,
                                                  "images": [encode(pixels, "JPEG")]})):
        rows: list[dict[str, float]] = []
        for _ in range(args.repeat + 1):
            started = time.perf_counter()
            scored = executor.score(request, profile=True)
            rows.append({**scored.timings_ms, "total": (time.perf_counter() - started) * 1000})
        rows = rows[1:]
        cell = {key: statistics.median(row.get(key, 0.0) for row in rows)
                for key in ("media", "encode", "backbone", "head", "total")}
        print(f"| {name} | {scored.encoding.length} | {cell['media']:.2f} | "
              f"{cell['encode']:.2f} | {cell['backbone']:.2f} | {cell['head']:.2f} | "
              f"{cell['total']:.2f} |")


if __name__ == "__main__":
    main()
