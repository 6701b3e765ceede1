"""Quotas under a flood: one named key (rate 20/s, burst 20) floods at C8 while another key
sends at C2. The flooding key is held to its rate (429 with Retry-After of at least one whole
second for the rest); the other key is never refused."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path

from stress.common import Connection, Report, clef_body, main_for

RATE, BURST = 20, 20
FLOOD_KEY, CALM_KEY = "sk-stress-flood-1a2b", "sk-stress-calm-3c4d"
KEYS = (f'[keys.flood]\nkey = "{FLOOD_KEY}"\nrate = {RATE}\nburst = {BURST}\npriority = "bulk"\n'
        f'[keys.calm]\nkey = "{CALM_KEY}"\n')


def scenario(report: Report) -> None:
    seconds = 3.0 if report.quick else 10.0
    with tempfile.TemporaryDirectory() as scratch:
        keys = Path(scratch) / "keys.toml"
        keys.write_text(KEYS)
        with report.serve(front_args=("--api-key-file", str(keys), "--max-batch", "4")) as serve:
            flood, calm, retry_after = asyncio.run(run(serve.port, seconds))
    allowed = BURST + RATE * seconds
    report.add("seconds", seconds)
    report.add("flood key statuses (C8)", dict(flood))
    report.add("calm key statuses (C2)", dict(calm))
    report.add("Retry-After values seen", dict(retry_after))
    report.check(set(flood) <= {200, 429} and flood[429] > 0, "the flooding key got 429s")
    report.check(flood[200] <= allowed * 1.1 + 2,
                 f"the flooding key got at most its burst + rate x time ({allowed:g}) answers")
    report.check(bool(retry_after) and min(retry_after) >= 1, "every Retry-After was >= 1")
    report.check(set(calm) == {200}, "the other key was never refused")


async def run(port: int, seconds: float
              ) -> tuple[Counter[int], Counter[int], Counter[int]]:
    flood: Counter[int] = Counter()
    calm: Counter[int] = Counter()
    retry_after: Counter[int] = Counter()
    stop = time.monotonic() + seconds

    async def client(key: str, statuses: Counter[int], index: int) -> None:
        connection = Connection(port)
        auth = [("Authorization", f"Bearer {key}")]
        try:
            i = 0
            while time.monotonic() < stop:
                body = clef_body(tag=f"{key[-4:]}-{index}-{i}")
                answer = await connection.request("POST", "/v1/systemone", body, tuple(auth))
                statuses[answer.status] += 1
                if answer.status == 429:
                    retry_after[int(answer.headers["retry-after"])] += 1
                    await asyncio.sleep(0.01)  # a flood, not a spin
                i += 1
        finally:
            await connection.close()

    await asyncio.gather(*(client(FLOOD_KEY, flood, n) for n in range(8)),
                         *(client(CALM_KEY, calm, n) for n in range(2)))
    return flood, calm, retry_after


main = main_for("quotas", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))
