"""Choose and load the executor named by the worker's flags.

Heavy imports (torch, transformers) happen inside the chosen executor's module, after the stdio
channel is claimed and the gdn-prefill guard has had its chance to run.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from clef_protocol.finetune import Finetune, scan_finetunes
from clef_protocol.options import limits_from
from clef_worker.errors import StartupError
from clef_worker.serving.executor import LoadedExecutor

log = logging.getLogger("clef_worker.variants")


def resolve_snapshot(model: str) -> tuple[Path, bool]:
    """Map `--model` to a snapshot directory; `demo` generates the built-in one on first use."""
    if model == "demo":
        from clef_worker.demo import ensure_demo_snapshot

        return ensure_demo_snapshot(), True
    path = Path(model).expanduser()
    if not path.is_dir():
        raise StartupError(f"--model {model}: no such snapshot directory")
    return path.resolve(), False


def finetunes_of(args: argparse.Namespace) -> list[Finetune]:
    """The checkpoints `--finetune` names now, resolved against the base's names (so none
    takes the base's name over); each one refused is logged at ERROR, naming it, and the rest
    is served. Read on every start: a roll or a replacement after a crash serves what is there
    then, never failing for a bad or missing entry (an empty directory: the base alone)."""
    finetunes, refused = scan_finetunes(args.finetune, base_names(args))
    for refusal in refused:
        log.error("variant refused, not served: %s", refusal)
    return finetunes


def load_executor(args: argparse.Namespace, snapshot: Path, demo: bool,
                  finetunes: list[Finetune] | None = None) -> LoadedExecutor:
    """Load the executor the flags ask for from the snapshot `resolve_snapshot` found, with the
    variants `finetunes_of` resolved (resolved here when not given); StartupError names what is
    wrong."""
    limits = limits_from(args)
    finetunes = finetunes_of(args) if finetunes is None else finetunes
    if args.finetune and args.executor == "release":
        raise StartupError("--finetune needs --executor native (the release executor runs the "
                           "snapshot's own code, which serves merged releases only)")
    if args.executor == "release":
        from clef_worker.release import ReleaseExecutor

        return ReleaseExecutor.load(
            snapshot, variant=args.variant, device=args.device, dtype=args.dtype,
            gdn_prefill=args.gdn_prefill, limits=limits, batch=args,
        )
    from clef_worker.assembly import ModelSettings, assemble

    return assemble(ModelSettings(
        snapshot_dir=snapshot, variant=args.variant, device=args.device, dtype=args.dtype,
        gdn_prefill=args.gdn_prefill, short_conv=args.short_conv, limits=limits, demo=demo,
        media=args.media, cuda_graphs=args.cuda_graphs, graph_max_length=args.graph_max_length,
        batch_layout=args.batch_layout, max_batch_tokens=args.max_batch_tokens,
        max_batch=args.max_batch, batch_window_ms=args.batch_window_ms, finetunes=tuple(finetunes),
        base_names=base_names(args), prefix_cache=args.prefix_cache,
        prefix_cache_bytes=args.prefix_cache_bytes,
    ))


def base_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The names the base model answers to: the front's served names and aliases
    (`--served-model-name`, which the front passes to a worker serving variants), and the
    `--variant`, the served name when none is given."""
    return (*(getattr(args, "served_model_name", None) or ()), args.variant)
