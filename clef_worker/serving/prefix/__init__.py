"""The prefix cache: a request whose leading tokens were read before runs only the rest.

| module | job |
|---|---|
| `cache` | the cache: keys, points, blocks, capacity, what to store (`StorePolicy`) |
| `run` | a group that reuses or stores: who reuses what, where each stores, the eager path |
| `graphed` | that group as packed-bucket replays with state inputs, rounds ending at points |

The model's arithmetic for a continued sequence lives below the serving wing
(`clef_worker.model.prefix_forward`, the eager reference; `clef_worker.model.stateful`, the
state inputs the buckets take); the start-up probe that checks the cache on the device is
`clef_worker.starting.prefix_probe`.
"""
