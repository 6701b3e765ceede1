"""Opt-in upstream executor (`--executor release`): answer with the snapshot's own Python code.

Why it exists: operators who want byte-for-byte the answers of Cloudflare's reference can have
them, and the native executor can be compared against the reference on real weights, without
this project copying or restating the release's `joint_schema_model.py`.

TRUST: this imports and runs `<snapshot>/joint_schema_model.py`, a file that came with the
downloaded snapshot, inside the worker process. Anyone who can write to that snapshot directory
(or who published it) can run arbitrary code with the server user's rights: read its files and
environment, open network connections, alter answers. Use it only with a snapshot from a source
you trust, verified against a pinned revision, in a directory only trusted users can write. The
default (`--executor native`) never executes anything from the snapshot.

The upstream interface (the release's file; the tests run the real one, tests/upstream.py):

- `load_release_model(path, device=..., dtype=...)` returns `(model, processor)`: it loads the
  backbone with `Qwen3_5ForConditionalGeneration.from_pretrained(..., device_map=...)` (which
  needs accelerate, the `release` extra), the head, and `AutoProcessor.from_pretrained(path)`.
  That processor includes Qwen3-VL's video processor, which transformers builds only with
  torchvision installed, and torchvision must be built for the installed torch (the CPU torch
  wheel has no matching torchvision on the package registry). Without one the release cannot
  start, and says so.
- `systemone(model, processor, request, max_length=...)` returns the response dict, whose
  `usage.input_tokens` becomes the Answer's token count (upstream reports no truncation).

The request given to `systemone` is the parsed JSON object, already checked by this project's
validation (so an invalid request never reaches upstream code). A `ValueError` whose message is
one of the reference's refusals (the owners' texts: `clef_protocol.validation.REFERENCE_REFUSALS`
and the encoder's `BUDGET`; in practice the budget, since this project runs checks 1-3 first)
becomes a 422 with that message; an error that broke the CUDA context becomes `ExecutorBroken`
(the worker exits and is replaced, `clef_worker.errors.broken_device_is_fatal`); anything else,
including other `ValueError`s from deeper code, is a 500 whose cause stays in the log. The
returned dict is serialised once, here.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import itertools
import logging
import re
import string
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from clef_protocol.body import parse_body
from clef_protocol.errors import RequestInvalid
from clef_protocol.messages import ModelInfo
from clef_protocol.options import RequestLimits
from clef_protocol.validation import REFERENCE_REFUSALS, validate_request
from clef_worker.errors import StartupError, broken_device_is_fatal
from clef_worker.model.answers import serialize
from clef_worker.model.encoding import BUDGET, Encoder
from clef_worker.model.kernel_choice import (
    DTYPE_NAMES,
    check_bound_gdn_path,
    choose_gdn_path,
    resolve_device,
    resolve_dtype,
)
from clef_worker.model.module_names import MODELING_MODULE
from clef_worker.model.snapshot import open_snapshot
from clef_worker.serving.executor import Answer
from clef_worker.serving.policy import DEFAULT_FLAGS, BatchFlags, BatchPolicy
from clef_worker.starting import warmup
from clef_worker.versions import package_versions

log = logging.getLogger(__name__)

RELEASE_FILE = "joint_schema_model.py"
LOADER = "load_release_model"
ANSWERER = "systemone"
_module_counter = itertools.count()


def _template_pattern(template: str) -> str:
    """A refusal template (`{qid}: ...`, `{fixed}`...) as a regular expression: its text
    literally, a numeric field as digits, the question id as anything."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(r".*" if field == "qid" else r"\d+")
    return "".join(parts)


# Only these are the reference refusing a request; a ValueError with any other text is an
# internal failure and must not reach clients as a 422.
REFERENCE_REFUSAL = re.compile(
    "|".join(f"(?:{_template_pattern(t)})" for t in (*REFERENCE_REFUSALS, BUDGET)), re.DOTALL)


class ReleaseExecutor:
    """The Executor protocol around the release's own `systemone` (see the module docstring)."""

    def __init__(self, *, module: ModuleType, model: Any, processor: Any, info: ModelInfo,
                 limits: RequestLimits, device: torch.device, policy: BatchPolicy,
                 warmup_request: dict[str, Any] | None = None) -> None:
        self.upstream_module = module  # the imported release module (for its other helpers)
        _, self._systemone = _interface(module, RELEASE_FILE)
        self.model = model  # the release's model object, as `load_release_model` returned it
        self.processor = processor
        self.device = device
        self._info = info
        self._limits = limits
        # It answers one request at a time (the serve loop adapts it), but the loop's window
        # and the budget `ready` reports still come from the flags, resolved here once.
        self.policy = policy
        self._warmup_request = warmup_request

    @classmethod
    def load(
        cls,
        snapshot: Path,
        *,
        variant: str,
        device: str,
        dtype: str,
        gdn_prefill: str,
        limits: RequestLimits,
        batch: BatchFlags = DEFAULT_FLAGS,
    ) -> ReleaseExecutor:
        """Import the snapshot's module, load the model through it, return a ready executor."""
        snapshot = Path(snapshot)
        source = snapshot / RELEASE_FILE
        if not source.is_file():
            raise StartupError(
                f"--executor release: {source} not found; this snapshot does not ship the "
                f"release's {RELEASE_FILE} (use --executor native)"
            )
        require_release_extra()
        # The same up-front checks as the native executor (files, head shapes, --variant), so a
        # broken snapshot fails with a clear message before any of its code runs.
        checked = open_snapshot(snapshot, variant=variant)
        # The warm-up is measured with this project's encoder, which makes the reference's
        # token-budget check, so it never asks upstream for more than --max-length allows.
        try:
            encoder = Encoder.from_file(checked.tokenizer_file)
        except Exception as exc:
            raise StartupError(f"{checked.tokenizer_file}: cannot load the tokenizer: {exc}") \
                from exc
        warmup_request = warmup.choose(
            limits, lambda request: encoder.encode(request, limits.max_length))
        target = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, target)
        # transformers binds the Gated DeltaNet kernel when the release module imports it: the
        # choice (and the fla block on CPU / --gdn-prefill torch) must be in place first.
        imported_before = MODELING_MODULE in sys.modules
        gdn_path = choose_gdn_path(gdn_prefill, target, torch_dtype)
        log.warning(
            "--executor release: running %s from the snapshot; it executes with this server's "
            "rights, use only a snapshot you trust", source,
        )
        module = _import_release_module(source)
        loader, _ = _interface(module, source)
        model, processor = _load_model(loader, source, snapshot, str(target), torch_dtype)
        if MODELING_MODULE in sys.modules:  # else the release did not use transformers' Qwen3.5
            gdn_path = check_bound_gdn_path(gdn_path, requested=gdn_prefill, device=target,
                                            imported_before=imported_before)
        info = ModelInfo(
            model=checked.variant,
            variant=checked.variant,
            device=str(target),
            dtype=DTYPE_NAMES[torch_dtype],
            gdn_path=gdn_path,
            versions={**package_versions(), RELEASE_FILE: _sha256(source)[:16]},
            demo=checked.random,
            snapshot=str(snapshot),
        )
        return cls(module=module, model=model, processor=processor, info=info, limits=limits,
                   device=target, policy=BatchPolicy.from_flags(str(target), batch),
                   warmup_request=warmup_request)

    def with_limits(self, limits: RequestLimits) -> ReleaseExecutor:
        """The same loaded release under other request limits (tests, comparisons)."""
        return type(self)(module=self.upstream_module, model=self.model,
                          processor=self.processor, info=self._info, limits=limits,
                          device=self.device, policy=self.policy)

    def describe(self) -> ModelInfo:
        return self._info

    def warm_up(self) -> None:
        """The richest warm-up request the limits admit (clef_worker.starting.warmup) through the
        upstream code, so its first-touch costs (allocations, kernel selection) are paid before
        `ready`. Upstream can only be driven with requests: when none fits, nothing is warmed."""
        if self._warmup_request is None:
            log.warning("no request fits --max-length %d (every request will be refused with "
                        "422); the release code is not warmed up", self._limits.max_length)
            return
        self._call(copy.deepcopy(self._warmup_request))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def answer(self, body: bytes) -> Answer:
        """Parse and validate here, let upstream score, serialise its dict once."""
        request = parse_body(body)
        validate_request(request, self._limits)
        try:
            response = self._call(request)
        except RequestInvalid:
            raise
        except ValueError as exc:
            if REFERENCE_REFUSAL.fullmatch(str(exc)):
                raise RequestInvalid(str(exc)) from exc
            raise
        if not isinstance(response, dict):
            raise TypeError(f"{RELEASE_FILE} {ANSWERER} returned {type(response).__name__}, "
                            "not a dict")
        usage = response.get("usage")
        tokens = usage.get("input_tokens") if isinstance(usage, dict) else None
        return Answer(serialize(response),
                      input_tokens=tokens if isinstance(tokens, int) else 0)

    def _call(self, request: dict[str, Any]) -> Any:
        with broken_device_is_fatal(self.device), torch.inference_mode():
            return self._systemone(self.model, self.processor, request,
                             max_length=self._limits.max_length)


RELEASE_EXTRA = ("accelerate",)


def require_release_extra() -> None:
    """The release loader passes a `device_map` to `from_pretrained`, which transformers only
    accepts with accelerate installed: say so at start-up, not deep inside upstream code."""
    missing = [name for name in RELEASE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise StartupError(
            f"--executor release needs {', '.join(missing)} (the release loads its model with a "
            "device_map): install it with pip install 'clef-serve[release]'"
        )


def _import_release_module(source: Path) -> ModuleType:
    """Import the file under a unique name, registered in sys.modules before it runs (so that
    dataclasses and pickling inside it can find their module), unregistered if it fails."""
    name = f"_clef_release_{next(_module_counter)}_{_sha256(source)[:12]}"
    spec = importlib.util.spec_from_file_location(name, source)
    if spec is None or spec.loader is None:
        raise StartupError(f"--executor release: cannot import {source}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise StartupError(
            f"--executor release: importing {source} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _interface(module: ModuleType, source: Path | str) -> tuple[Any, Any]:
    """The release's loader and answerer; StartupError when the module lacks either."""
    loader = getattr(module, LOADER, None)
    systemone = getattr(module, ANSWERER, None)
    if not (callable(loader) and callable(systemone)):
        raise StartupError(
            f"--executor release: {source} lacks {LOADER}() or {ANSWERER}(), the release's "
            "interface (see clef_worker/release.py)"
        )
    return loader, systemone


def _load_model(loader: Any, source: Path, snapshot: Path, device: str,
                dtype: torch.dtype) -> tuple[Any, Any]:
    """`(model, processor)` through the release's loader; a failure is a StartupError that
    names it (and, for the processor's torchvision, what to install)."""
    try:
        loaded = loader(snapshot, device=device, dtype=dtype)
    except Exception as exc:
        hint = (" (the release's processor needs torchvision built for the installed torch: "
                "install it from the index torch came from)"
                if isinstance(exc, ImportError) and "torchvision" in str(exc).lower() else "")
        text = " ".join(str(exc).split())  # one line: it ends up in the `fatal` frame
        raise StartupError(
            f"--executor release: {source}: {LOADER}() failed: {type(exc).__name__}: "
            f"{text}{hint}"
        ) from exc
    if not (isinstance(loaded, tuple) and len(loaded) == 2):
        raise StartupError(f"--executor release: {source}: {LOADER} returned "
                           f"{type(loaded).__name__}, expected (model, processor)")
    return loaded[0], loaded[1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
