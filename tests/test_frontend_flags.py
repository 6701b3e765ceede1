"""The model flags: one table, read the same way by `clef-serve`, its help and the worker.

Every model and limit flag is given a value other than its default on the front's command
line; the worker command built from it must parse, with the worker's own parser, to the very
same values. The help text's defaults must be the numbers the code uses.
"""

from __future__ import annotations

import argparse
import re

import pytest

from benchlib.paths import FINETUNE_FIXTURES
from clef_dispatch.worker_pool import plan_slots
from clef_frontend.cli import build_parser, config_from
from clef_protocol.arg_types import non_negative_float
from clef_protocol.options import (
    Device,
    add_model_arguments,
    device_arg,
    parse_device,
    prefix_cache_bytes,
    worker_argv,
)
from clef_worker.main import parse_args as worker_parse_args
from clef_worker.serving.policy import default_max_batch_tokens, default_max_sequences


def model_actions() -> list[argparse.Action]:
    table = argparse.ArgumentParser(add_help=False)
    add_model_arguments(table)
    return [action for action in table._actions if action.option_strings]


def other_value(action: argparse.Action) -> str:
    """A valid value for the flag that differs from its default."""
    if action.choices:
        return next(str(choice) for choice in action.choices if choice != action.default)
    if action.type is device_arg:
        return "cuda:3"
    if action.type is non_negative_float:
        return "2.75"
    if action.type is prefix_cache_bytes:  # `auto` by default, else bytes
        return "4096"
    if isinstance(action.default, int):
        return str(action.default + 3)
    if isinstance(action.default, list):  # --finetune: the front lists the checkpoints it names
        return f"{action.dest}={FINETUNE_FIXTURES / 'tiny-alpha'}"
    return f"/snapshots/{action.dest}"


def test_every_model_flag_survives_the_trip_to_the_worker() -> None:
    actions = model_actions()
    assert len(actions) >= 19  # the table is walked, not a list kept beside it
    front_argv = [part for action in actions
                  for part in (action.option_strings[0], other_value(action))]
    front = build_parser().parse_args(["--worker-command", "w", *front_argv])
    passed = worker_argv(front)
    worker = worker_parse_args(passed)
    for action in actions:
        sent = getattr(front, action.dest)
        assert sent != action.default, action.dest  # the trip is tested with a changed value
        assert getattr(worker, action.dest) == sent, action.dest
    # ... and the front's config starts the worker with exactly those flags.
    assert config_from(front).workers.worker_argv == ("w", *passed)


def test_default_flags_round_trip_too() -> None:
    front = build_parser().parse_args([])
    worker = worker_parse_args(worker_argv(front))
    for action in model_actions():
        assert getattr(worker, action.dest) == getattr(front, action.dest) == action.default


def _help_of(flag: str) -> str:
    for action in build_parser()._actions:
        if flag in action.option_strings:
            return action.help or ""
    raise AssertionError(flag)


def _numbers_by_device(help_text: str) -> dict[str, int]:
    return {device: int(number) for number, device in
            re.findall(r"(\d+) on (?:a )?(CUDA|CPU)", help_text)}


def test_help_defaults_are_the_ones_the_code_uses() -> None:
    tokens = _numbers_by_device(_help_of("--max-batch-tokens"))
    assert tokens == {"CUDA": default_max_batch_tokens("cuda"),
                      "CPU": default_max_batch_tokens("cpu")}
    batch = _numbers_by_device(_help_of("--max-batch"))
    assert batch == {"CUDA": default_max_sequences("cuda"), "CPU": default_max_sequences("cpu")}


@pytest.mark.parametrize(("text", "device"), [
    ("auto", Device("auto")), ("cpu", Device("cpu")), ("cuda", Device("cuda")),
    ("cuda:0", Device("cuda", 0)), ("cuda:12", Device("cuda", 12)),
])
def test_the_device_grammar(text: str, device: Device) -> None:
    assert parse_device(text) == device
    assert str(device) == text


@pytest.mark.parametrize("text", ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "CUDA",
                                  "cuda:١"])
def test_the_device_grammar_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        parse_device(text)


def test_devices_are_parsed_by_the_one_grammar_and_pin_their_gpu() -> None:
    parser = build_parser()
    args = parser.parse_args(["--devices", "cuda:1, cpu", "--worker-command", "w"])
    slots = plan_slots(config_from(args).workers)
    assert [(slot.name, slot.env.get("CUDA_VISIBLE_DEVICES")) for slot in slots] == [
        ("cuda:1", "1"), ("cpu", None)]
    assert slots[0].argv[-2:] == ("--device", "cuda")
    for refused in ("cuda", "auto", "cuda:1,cuda:1", "tpu:0"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--devices", refused])


def _worker_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[object, str | None]]:
    """The worker group's flags: name -> (default, help)."""
    group = next(g for g in parser._action_groups if g.title == "workers")
    return {action.option_strings[0]: (action.default, action.help)
            for action in group._group_actions}


def test_clef_serve_and_clef_batch_share_one_worker_flag_group(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Same flags, same defaults, same help: one definition (dispatch.settings); clef-batch
    adds only its give-up (`--max-restarts`), and both refuse a bad value the same way."""
    from clef_tools.batch import build_parser as batch_parser

    serve, batch = _worker_flags(build_parser()), _worker_flags(batch_parser())
    assert set(batch) - set(serve) == {"--max-restarts"}
    assert {name: batch[name] for name in serve} == serve
    assert serve["--stall-timeout"][0] == 30.0
    for parser, required in ((build_parser(), []),
                             (batch_parser(), ["--input", "i", "--output", "o"])):
        assert parser.parse_args([*required, "--stall-timeout", "5"]).stall_timeout == 5.0
        with pytest.raises(SystemExit):
            parser.parse_args([*required, "--stall-timeout", "0"])
        assert "--stall-timeout: expected a positive number of seconds" in capsys.readouterr().err


def test_clef_tools_imports_nothing_from_the_servers_cli() -> None:
    """clef_tools reaches the front through its packages (dispatch, routes), never through
    `clef-serve`'s command line."""
    import ast
    from pathlib import Path

    import clef_tools

    for path in Path(clef_tools.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names}
        assert "clef_frontend.cli" not in imported, path
