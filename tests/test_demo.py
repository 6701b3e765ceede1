"""The demo snapshot: deterministic, complete, release-shaped, cached atomically, and servable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clef_worker import demo
from clef_worker.assembly import assemble_snapshot
from clef_worker.demo import generate, layout
from clef_worker.errors import StartupError
from clef_worker.model.snapshot import RANDOM_MARKER

REPO = Path(__file__).resolve().parent.parent

# Files spec §1 needs for text-only serving (the processor/chat assets and the upstream
# joint_schema_model.py are not used by this project), plus the demo marker.
NEEDED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "joint_head_config.json",
    "joint_head.safetensors",
    RANDOM_MARKER,
)


def _hashes(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in demo.snapshot_files(directory)
    }


def _tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return {
            name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
            for name in handle.keys()  # noqa: SIM118 - safe_open is not a mapping
        }


@pytest.fixture(scope="session")
def demo_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_demo_snapshot(tmp_path_factory.mktemp("demo-cache"))


def test_generation_is_deterministic(demo_snapshot: Path, tmp_path: Path) -> None:
    again = demo.generate_snapshot(tmp_path / "again")
    assert _hashes(again) == _hashes(demo_snapshot)


def test_generation_is_deterministic_across_processes(demo_snapshot: Path, tmp_path: Path) -> None:
    # A fresh interpreter has different hash seeds (Python's and the Rust tokenizer trainer's).
    out = tmp_path / "child"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    code = "import sys; from clef_worker.demo import generate_snapshot as g; g(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=env, check=True)
    assert _hashes(out) == _hashes(demo_snapshot)


def test_layout_is_complete(demo_snapshot: Path) -> None:
    assert {p.name for p in demo.snapshot_files(demo_snapshot)} == set(NEEDED)
    config = json.loads((demo_snapshot / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5"
    text = config["text_config"]
    assert text["hidden_size"] == 64
    assert text["tie_word_embeddings"] is False
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["vision_config"]["out_hidden_size"] == 64

    head_config = json.loads((demo_snapshot / "joint_head_config.json").read_text())
    assert head_config == {"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 2,
                           "heads": 4, "feedforward": 64}

    tensors = _tensor_shapes(demo_snapshot / "model.safetensors")
    assert {dtype for _, dtype in tensors.values()} == {"BF16"}
    assert any(name.startswith("model.language_model.layers.") for name in tensors)
    assert any(name.startswith("model.visual.") for name in tensors)
    vocab_rows = text["vocab_size"]
    assert tensors["lm_head.weight"][0] == (vocab_rows, 64)
    assert tensors["model.language_model.embed_tokens.weight"][0] == (vocab_rows, 64)

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_snapshot / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= vocab_rows
    assert "demo" in (demo_snapshot / RANDOM_MARKER).read_text()


def test_names_and_shapes_match_the_reference_fixture(demo_snapshot: Path,
                                                      tiny_snapshot: Path) -> None:
    # The shared tiny fixture has the same widths: every tensor name and shape must agree, except
    # the vocabulary rows, which follow each snapshot's own tokenizer.
    head = _tensor_shapes(demo_snapshot / "joint_head.safetensors")
    assert head == _tensor_shapes(tiny_snapshot / "joint_head.safetensors")
    assert len(head) == 9 + 14 * 2 + 6 + 18 * 2 + 4 + 3

    ours = _tensor_shapes(demo_snapshot / "model.safetensors")
    theirs = _tensor_shapes(tiny_snapshot / "model.safetensors")
    assert set(ours) == set(theirs)
    vocab_tables = {"lm_head.weight", "model.language_model.embed_tokens.weight"}
    for name in set(ours) - vocab_tables:
        assert ours[name] == theirs[name], name


def test_prompt_special_tokens_encode_to_single_ids(demo_snapshot: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_snapshot / "tokenizer.json"))
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                 "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"):
        ids = tokenizer.encode(f"a{text}b", add_special_tokens=False).ids
        assert tokenizer.token_to_id(text) in ids, text
        assert len(ids) == 3, text
    suffix = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
    encoding = tokenizer.encode(suffix, add_special_tokens=False)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == suffix


def test_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = demo.ensure_demo_snapshot(tmp_path)
    marker_mtime = (first / RANDOM_MARKER).stat().st_mtime_ns

    def must_not_run(*_args: object, **_kwargs: object) -> Path:
        raise AssertionError("the cached snapshot was regenerated")

    monkeypatch.setattr(generate, "generate_snapshot", must_not_run)
    assert demo.ensure_demo_snapshot(tmp_path) == first
    assert (first / RANDOM_MARKER).stat().st_mtime_ns == marker_mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind


def test_cache_root_follows_the_environment(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.default_cache_root() == tmp_path / "explicit"
    monkeypatch.delenv(demo.CACHE_ENV)
    assert demo.default_cache_root() == tmp_path / "xdg" / "clef-serve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.default_cache_root() == tmp_path / "home" / ".cache" / "clef-serve"


def test_a_failed_generation_leaves_nothing(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*_args: object, **_kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(generate, "save_tensors", crash)
    with pytest.raises(StartupError, match="disk full"):
        demo.ensure_demo_snapshot(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_concurrent_winner_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_generate = demo.generate_snapshot
    final = tmp_path / demo.demo_snapshot_name()

    def race(dest: Path, spec: demo.DemoSpec = demo.DemoSpec()) -> Path:  # noqa: B008
        real_generate(final, spec)  # another worker publishes first...
        return real_generate(dest, spec)  # ...while we are still building ours

    monkeypatch.setattr(generate, "generate_snapshot", race)
    assert demo.ensure_demo_snapshot(tmp_path) == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_unwritable_cache_is_a_startup_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StartupError, match="demo snapshot cache"):
        demo.ensure_demo_snapshot(blocker / "cache")


def test_layout_read_in_a_child_process_is_the_same(demo_snapshot: Path) -> None:
    # The child path runs when fla is importable here; it must not change the layout.
    config_text = (demo_snapshot / "config.json").read_text()
    assert layout._layout_in_child(config_text) == layout._layout_from_config_text(config_text)


def test_native_executor_serves_the_demo(demo_snapshot: Path) -> None:
    from clef_protocol.options import RequestLimits

    executor = assemble_snapshot(
        demo_snapshot, variant="clef-flash", device="cpu", dtype="float32",
        gdn_prefill="torch", limits=RequestLimits(), demo=True,
    )
    assert executor.describe().demo is True
    executor.warm_up()
    request = {
        "model": "demo",
        "state": {"user": "My parcel arrived broken, I want my money back."},
        "questions": {
            "refund": {"type": "noul", "instructions": "Does the user ask for a refund?"},
            "topic": {"type": "choice", "criteria": {"delivery": "Shipping", "billing": None,
                                                     "account": "Login problems"}},
            "tone": {"type": "score", "criteria": ["calm", "annoyed", "furious"]},
        },
    }
    response = json.loads(executor.answer(json.dumps(request).encode()).body)
    assert response["model"] == "demo"
    assert list(response["answers"]) == ["refund", "topic", "tone"]
    assert 0.0 < response["answers"]["refund"]["noul"] < 1.0
    topic = response["answers"]["topic"]
    assert list(topic["probabilities"]) == ["delivery", "billing", "account"]
    probabilities = list(topic["probabilities"].values())
    assert abs(sum(probabilities) - 1.0) < 1e-3
    assert max(probabilities) - min(probabilities) > 1e-3  # random, but not degenerate
    assert response["usage"]["input_tokens"] > 0


def test_an_importable_fla_sends_the_layout_to_a_child(tmp_path: Path) -> None:
    """With an unblocked fla on the path, importing the modelling module in-process would bind
    its kernel before the executor's guard: generating a snapshot must leave the modelling
    module, fla and causal_conv1d unimported in this process (the child reads the layout)."""
    fake = tmp_path / "site"
    (fake / "fla").mkdir(parents=True)
    (fake / "fla" / "__init__.py").write_text("raise RuntimeError('fla imported in-process')\n")
    code = (
        "import sys\n"
        "from clef_worker.model.module_names import MODELING_MODULE\n"
        "from clef_worker.demo import generate_snapshot, layout\n"
        "assert not layout._modelling_import_is_harmless()\n"
        "generate_snapshot(sys.argv[1])\n"
        "print(sorted(m for m in (MODELING_MODULE, 'fla', 'causal_conv1d') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(REPO)])}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "snapshot")], cwd=REPO,
                            env=env, capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert (tmp_path / "snapshot" / "model.safetensors").is_file()


def test_blocked_or_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    assert not layout._blocked_or_absent("fla")
    monkeypatch.setitem(sys.modules, "fla", None)
    assert layout._blocked_or_absent("fla")
