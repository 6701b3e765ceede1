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

Assumed upstream interface. We do not have the release's file, so the adapter is written against
the smallest interface that public code calling the release relies on, and probes for it:

  A. module-level `load_release_model(snapshot_dir, device=..., dtype=...)` returning
     `(model, processor)`, and module-level `systemone(model, processor, request) -> dict`;
  B. (fallback) module-level `load(snapshot_dir, device=..., dtype=...)` returning an object with
     a `systemone(request) -> dict` method.

`snapshot_dir` is a `pathlib.Path`, `device` a string such as "cpu" or "cuda:0", `dtype` a
`torch.dtype`. If the `systemone` callable names a `max_length` parameter, `--max-length` is passed
to it. The request given to it is the parsed JSON object, already checked by this project's
validation (so an invalid request never reaches upstream code); a `ValueError` whose message is
one of the reference's refusals (spec §2; in practice the budget check, check 4, since this
project runs checks 1-3 first) becomes a 422 with that message; any other exception, including
other `ValueError`s from deeper code, is a 500 whose cause stays in the log. The returned dict
is serialised once, here. A snapshot whose module offers neither form fails start-up with a
message saying what was looked for.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import inspect
import itertools
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from clef_protocol.body import parse_body
from clef_protocol.errors import RequestInvalid
from clef_protocol.messages import ModelInfo
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker import warmup
from clef_worker.errors import StartupError
from clef_worker.executor import Answer
from clef_worker.model.answers import serialize
from clef_worker.model.backbone import (
    DTYPE_NAMES,
    MODELING_MODULE,
    bound_gdn_path,
    choose_gdn_path,
    resolve_device,
    resolve_dtype,
)
from clef_worker.model.encoding import Encoder
from clef_worker.model.kernel_advice import quiet_on_cpu
from clef_worker.model.snapshot import open_snapshot
from clef_worker.versions import package_versions

log = logging.getLogger(__name__)

RELEASE_FILE = "joint_schema_model.py"
_module_counter = itertools.count()

Answerer = Callable[[dict[str, Any]], Any]

# The reference's refusal messages (clef-model.md §2). Only these are the reference refusing a
# request; a ValueError with any other text is an internal failure and must not reach clients.
REFERENCE_REFUSAL = re.compile(
    r"model and state are required"
    r"|at least one question is required"
    r"|.*: type must be noul, choice, or score"
    r"|.*: criteria must not be empty"
    r"|schema requires \d+ tokens before state; maximum is \d+",
    re.DOTALL,
)


class ReleaseExecutor:
    """The Executor protocol around the release's own `systemone` (see the module docstring)."""

    def __init__(self, answerer: Answerer, info: ModelInfo, limits: RequestLimits,
                 module: ModuleType, warmup_request: dict[str, Any] | None = None) -> None:
        self._answerer = answerer
        self._info = info
        self._limits = limits
        self._module = module
        self._warmup_request = warmup_request

    @property
    def upstream_module(self) -> ModuleType:
        """The imported release module (for comparisons that need its other helpers)."""
        return self._module

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
        device_name = str(target)
        # transformers binds the Gated DeltaNet kernel when the release module imports it: the
        # choice (and the fla block on CPU / --gdn-prefill torch) must be in place first.
        gdn_path = choose_gdn_path(gdn_prefill, target, torch_dtype)
        log.warning(
            "--executor release: running %s from the snapshot; it executes with this server's "
            "rights, use only a snapshot you trust", source,
        )
        module = _import_release_module(source)
        answerer = _bind_interface(module, source, snapshot, device_name, torch_dtype, limits)
        gdn_path = _check_bound_path(gdn_path, quiet_on_cpu(target))
        info = ModelInfo(
            model=checked.variant,
            variant=checked.variant,
            device=device_name,
            dtype=DTYPE_NAMES[torch_dtype],
            gdn_path=gdn_path,
            versions={**package_versions(), RELEASE_FILE: _sha256(source)[:16]},
            demo=checked.random,
            snapshot=str(snapshot),
        )
        return cls(answerer, info, limits, module, warmup_request)

    def describe(self) -> ModelInfo:
        return self._info

    def warm_up(self) -> None:
        """The richest warm-up request the limits admit (clef_worker.warmup) through the
        upstream code, so its first-touch costs (allocations, kernel selection) are paid before
        `ready`. Upstream can only be driven with requests: when none fits, nothing is warmed."""
        if self._warmup_request is None:
            log.warning("no request fits --max-length %d (every request will be refused with "
                        "422); the release code is not warmed up", self._limits.max_length)
            return
        self._call(copy.deepcopy(self._warmup_request))
        _synchronize(self._info.device)

    def answer(self, body: bytes) -> Answer:
        """Parse and validate here, let upstream score, serialise its dict once.

        The upstream interface reports no token counts, so the Answer's counts stay 0.
        """
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
            raise TypeError(f"{RELEASE_FILE} systemone returned {type(response).__name__}, "
                            "not a dict")
        return Answer(serialize(response))

    def _call(self, request: dict[str, Any]) -> Any:
        import torch

        with torch.inference_mode():
            return self._answerer(request)


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


def _check_bound_path(chosen: str, why: str | None = None) -> str:
    """After the release imported transformers: did it bind the kernel that was chosen?
    (`why`, when given, ends the log line that says which path runs.)"""
    if MODELING_MODULE not in sys.modules:
        return chosen  # the release did not use transformers' Qwen3.5 module (yet)
    bound = bound_gdn_path()
    if bound == "unknown":
        return chosen
    if bound != chosen:
        raise StartupError(
            f"transformers bound the {bound} Gated DeltaNet kernel but {chosen} was chosen "
            "(its Qwen3.5 module was imported before the guard ran); start the worker in a "
            "fresh process"
        )
    log.info("Gated DeltaNet prefill path: %s%s", bound, f": {why}" if why else "")
    return bound


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


def _bind_interface(
    module: ModuleType,
    source: Path,
    snapshot: Path,
    device: str,
    dtype: Any,
    limits: RequestLimits,
) -> Answerer:
    """Find one of the assumed interface forms and load the model through it."""
    load_release_model = getattr(module, "load_release_model", None)
    systemone = getattr(module, "systemone", None)
    if callable(load_release_model) and callable(systemone):
        loaded = _load_through(load_release_model, "load_release_model", source, snapshot,
                               device, dtype)
        if not (isinstance(loaded, tuple) and len(loaded) == 2):
            raise StartupError(f"--executor release: {source}: load_release_model returned "
                               f"{type(loaded).__name__}, expected (model, processor)")
        model, processor = loaded
        extra = _max_length_kwargs(systemone, limits)
        return lambda request: systemone(model, processor, request, **extra)

    load = getattr(module, "load", None)
    if callable(load):
        loaded = _load_through(load, "load", source, snapshot, device, dtype)
        method = getattr(loaded, "systemone", None)
        if not callable(method):
            raise StartupError(f"--executor release: {source}: load() returned "
                               f"{type(loaded).__name__} without a systemone method")
        extra = _max_length_kwargs(method, limits)
        return lambda request: method(request, **extra)

    raise StartupError(
        f"--executor release: {source} has neither load_release_model() with systemone() nor "
        "load() returning an object with systemone(); see clef_worker/release.py for the "
        "interface this server expects"
    )


def _load_through(loader: Callable[..., Any], what: str, source: Path, snapshot: Path,
                  device: str, dtype: Any) -> Any:
    try:
        return loader(snapshot, device=device, dtype=dtype)
    except Exception as exc:
        raise StartupError(
            f"--executor release: {source}: {what}() failed: {type(exc).__name__}: {exc}"
        ) from exc


def _max_length_kwargs(function: Callable[..., Any], limits: RequestLimits) -> dict[str, int]:
    """Pass `--max-length` only where upstream names the parameter (else it uses its default)."""
    with contextlib.suppress(TypeError, ValueError):
        if "max_length" in inspect.signature(function).parameters:
            return {"max_length": limits.max_length}
    return {}


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
