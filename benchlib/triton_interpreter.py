"""fla's real Triton kernels on CPU under Triton's interpreter: the harness the interpreter tests
(tests/fla_interpreter.py and its siblings) and the operation count (bench/bench_forward_ops.py)
share. Run it in a process of its own: Triton reads `TRITON_INTERPRET` when fla's kernels are
defined, so it must be set before fla is first imported.

Two things stand between fla-core 0.6.0 and the interpreter (triton 3.9.0), both fixed here in
the harness, never in fla:

- Autotuning: `Autotuner` times each config through the active driver's benchmarker, and the
  interpreter has no such driver. `equal_autotune_timings` gives every config the same timing
  without running it, so the autotuner keeps the first config (its `min` over equal values)
  and only that one runs.
- Loops: under the compiler a `range` loop's index inside a kernel is a Triton scalar, and
  fla's `chunk_delta_h` and `chunk_o` call `.to(tl.int64)` on it; the interpreter runs the loop
  in Python and hands out a plain int, which has no `.to`. The interpreter executes a kernel's
  body with its module's globals (`triton.runtime.interpreter.FunctionRewriter`), so those
  modules get a module-level `range` (`interpreter_range`) that yields interpreter scalars.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# The fla modules whose kernels call `.to()` on a `range` loop's index.
RANGE_MODULES = ("fla.ops.common.chunk_delta_h", "fla.ops.common.chunk_o")


def equal_autotune_timings() -> None:
    """Every autotune config times the same and none is run to time it: the first is kept."""
    from triton.runtime.autotuner import Autotuner

    def same_for_all(kernel_call: Any, quantiles: Any) -> list[float]:
        return [0.0, 0.0, 0.0]

    # A class attribute in place of Autotuner's cached `do_bench` property (the driver's
    # benchmarker, which the interpreter does not have).
    Autotuner.do_bench = staticmethod(same_for_all)


def interpreter_range(*bounds: Any) -> Iterator[Any]:
    """`range` for an interpreted kernel body: bounds may be interpreter scalars; each index is
    an interpreter scalar (int32, as the compiler types a loop index), so `.to()` works."""
    import triton.language as tl
    from triton.runtime.interpreter import interpreter_semantic

    ints = [int(b.handle.data.item()) if isinstance(b, tl.tensor) else int(b) for b in bounds]
    for index in builtins.range(*ints):
        yield interpreter_semantic.to_tensor(index, False)


def interpreted_loops(modules: Sequence[str] = RANGE_MODULES) -> None:
    for name in modules:
        module = importlib.import_module(name)
        module.range = interpreter_range  # type: ignore[attr-defined]


def prepare() -> None:
    """The harness: refuse to run unless the interpreter is on before fla is imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET=1 must be set before fla is imported")
    if "fla" in sys.modules:
        raise SystemExit("fla was imported before the harness: its kernels are not interpreted")
    equal_autotune_timings()
    interpreted_loops()


def run_harness(measure: Callable[[], dict[str, Any]]) -> int:
    """A harness process's whole main: the interpreter prepared, `measure` run, its result
    printed as one JSON line for the test that started the process to read."""
    prepare()
    print(json.dumps(measure()))
    return 0


def harness_result(module: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the harness `module` (`python -m module`) in a process of its own with the
    interpreter on, and return the JSON line its `run_harness` printed."""
    import subprocess

    from benchlib.paths import REPO

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
