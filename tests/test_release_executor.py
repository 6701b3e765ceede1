"""`--executor release`: the adapter around a snapshot's own joint_schema_model.py.

The real upstream file is not available (and must not be copied), so each test writes a fake
module into a temporary snapshot that implements the assumed interface and records its calls.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.options import RequestLimits
from clef_worker import demo, warmup
from clef_worker.errors import StartupError
from clef_worker.release import RELEASE_FILE, ReleaseExecutor
from tests.conftest import REPO

# Interface form A: load_release_model(...) -> (model, processor); systemone(model, processor,
# request). The dataclass needs the module registered in sys.modules while it is executed.
FORM_A = '''
from dataclasses import dataclass

CALLS = []
LOADED = {}


@dataclass
class Model:
    snapshot: object
    device: object
    dtype: object


def load_release_model(snapshot_dir, device=None, dtype=None):
    LOADED.update(snapshot=snapshot_dir, device=device, dtype=dtype)
    return Model(snapshot_dir, device, dtype), "processor"


def systemone(model, processor, request, max_length=16384):
    CALLS.append((request, max_length))
    if request.get("state") == "refuse":
        raise ValueError("schema requires 99 tokens before state; maximum is 10")
    if request.get("state") == "crash":
        raise RuntimeError("boom")
    if request.get("state") == "internal":
        raise ValueError("expected 2D input, got tensor of shape [3, 4, 5]")
    answers = {qid: {"type": q["type"], "noul": 0.25} for qid, q in request["questions"].items()}
    return {"model": request["model"], "answers": answers,
            "usage": {"input_tokens": 7, "output_tokens": 0}, "note": "é"}
'''

# Interface form B: load(...) -> object with a systemone(request) method.
FORM_B = '''
CALLS = []


class Scorer:
    def systemone(self, request):
        CALLS.append(request)
        return {"model": request["model"], "answers": {}, "usage": {"input_tokens": 1,
                                                                  "output_tokens": 0}}


def load(snapshot_dir, device=None, dtype=None):
    return Scorer()
'''

MakeSnapshot = Callable[..., Path]

VALID = {"model": "m", "state": "hello", "questions": {"q": {"type": "noul"}}}


@pytest.fixture(scope="module")
def base_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete (random) snapshot; each test copies it and adds its own upstream module."""
    return demo.generate_snapshot(tmp_path_factory.mktemp("release-base") / "snapshot")


@pytest.fixture
def make_snapshot(base_snapshot: Path, tmp_path: Path) -> MakeSnapshot:
    def make(source: str | None, name: str = "snapshot") -> Path:
        snapshot = tmp_path / name
        shutil.copytree(base_snapshot, snapshot)
        if source is not None:
            (snapshot / RELEASE_FILE).write_text(textwrap.dedent(source))
        return snapshot

    return make


def _load(snapshot: Path, limits: RequestLimits | None = None) -> ReleaseExecutor:
    return ReleaseExecutor.load(
        snapshot, variant="clef-flash", device="cpu", dtype="float32", gdn_prefill="torch",
        limits=limits or RequestLimits(),
    )


def _module(executor: ReleaseExecutor) -> Any:
    return executor.upstream_module


def _body(request: object) -> bytes:
    return json.dumps(request).encode()


def test_missing_file_fails_startup(make_snapshot: MakeSnapshot) -> None:
    with pytest.raises(StartupError, match=RELEASE_FILE):
        _load(make_snapshot(None))


def test_form_a_answers_and_serialises_once(make_snapshot: MakeSnapshot) -> None:
    import torch

    snapshot = make_snapshot(FORM_A)
    executor = _load(snapshot, RequestLimits(max_length=4096))
    module = _module(executor)
    assert module.LOADED["snapshot"] == snapshot
    assert (module.LOADED["device"], module.LOADED["dtype"]) == ("cpu", torch.float32)

    answer = executor.answer(_body(VALID))
    body = answer.body
    assert isinstance(body, bytes)
    assert (answer.input_tokens, answer.truncated_tokens) == (0, 0)  # upstream reports none
    assert json.loads(body) == {"model": "m", "answers": {"q": {"type": "noul", "noul": 0.25}},
                                "usage": {"input_tokens": 7, "output_tokens": 0}, "note": "é"}
    assert "é" in body.decode("utf-8")  # UTF-8, not \\u escapes
    assert module.CALLS[-1] == (VALID, 4096)  # --max-length reaches upstream

    info = executor.describe()
    assert (info.device, info.dtype, info.gdn_path) == ("cpu", "float32", "torch")
    assert info.snapshot == str(snapshot)
    assert RELEASE_FILE in info.versions
    assert info.demo is True  # the base snapshot carries the random-model marker


def test_warm_up_goes_through_upstream(make_snapshot: MakeSnapshot) -> None:
    executor = _load(make_snapshot(FORM_A))
    module = _module(executor)
    executor.warm_up()
    assert len(module.CALLS) == 1
    assert module.CALLS[0][0] == warmup.REPRESENTATIVE  # default limits: the richest request


def test_warm_up_fits_a_short_max_length(make_snapshot: MakeSnapshot) -> None:
    """A --max-length that no request fits starts anyway; upstream is then never called."""
    executor = _load(make_snapshot(FORM_A), limits=RequestLimits(max_length=64))
    module = _module(executor)
    executor.warm_up()
    assert module.CALLS == []
    executor = _load(make_snapshot(FORM_A, "other"), limits=RequestLimits(max_length=200))
    module = _module(executor)
    executor.warm_up()
    (call,) = module.CALLS
    assert call[1] == 200 and call[0] != warmup.REPRESENTATIVE


@pytest.mark.parametrize("request_", [
    {"state": "x", "questions": {"q": {"type": "noul"}}},
    {"model": "m", "state": "x", "questions": {}},
    {"model": "m", "state": "x", "questions": {"q": {"type": "maybe"}}},
    {"model": "m", "state": "x", "questions": {"q": "not an object"}},
    {"model": "m", "state": "x", "questions": {"q": {"type": "choice", "criteria": ["a"]}}},
    {"model": "m", "state": "x", "questions": {"q": {"type": "noul"}}, "images": ["x.png"]},
])
def test_invalid_requests_never_reach_upstream(make_snapshot: MakeSnapshot, request_: dict) -> None:
    executor = _load(make_snapshot(FORM_A))
    module = _module(executor)
    with pytest.raises(RequestInvalid):
        executor.answer(_body(request_))
    assert module.CALLS == []


def test_unparsable_body_is_a_bad_request(make_snapshot: MakeSnapshot) -> None:
    executor = _load(make_snapshot(FORM_A))
    with pytest.raises(BadRequestBody):
        executor.answer(b'{"model": "m", "model": "n"}')
    assert _module(executor).CALLS == []


def test_upstream_value_error_is_a_422_with_its_message(make_snapshot: MakeSnapshot) -> None:
    executor = _load(make_snapshot(FORM_A))
    with pytest.raises(RequestInvalid) as caught:
        executor.answer(_body({**VALID, "state": "refuse"}))
    assert str(caught.value) == "schema requires 99 tokens before state; maximum is 10"


def test_other_upstream_errors_are_not_422(make_snapshot: MakeSnapshot) -> None:
    executor = _load(make_snapshot(FORM_A))
    with pytest.raises(RuntimeError, match="boom"):
        executor.answer(_body({**VALID, "state": "crash"}))


def test_an_internal_value_error_is_not_a_422(make_snapshot: MakeSnapshot) -> None:
    """Only the reference's own refusal texts become 422; anything else stays a 500."""
    executor = _load(make_snapshot(FORM_A))
    with pytest.raises(ValueError, match="expected 2D input") as caught:
        executor.answer(_body({**VALID, "state": "internal"}))
    assert not isinstance(caught.value, RequestInvalid)


def test_form_b(make_snapshot: MakeSnapshot) -> None:
    executor = _load(make_snapshot(FORM_B))
    assert json.loads(executor.answer(_body(VALID)).body)["model"] == "m"
    assert _module(executor).CALLS == [VALID]


def test_unknown_interface_fails_startup(make_snapshot: MakeSnapshot) -> None:
    with pytest.raises(StartupError, match="load_release_model"):
        _load(make_snapshot("def score(request):\n    return {}\n"))


def test_import_error_fails_startup_and_unregisters(make_snapshot: MakeSnapshot) -> None:
    before = set(sys.modules)
    with pytest.raises(StartupError, match="ZeroDivisionError"):
        _load(make_snapshot("x = 1 / 0\n"))
    assert not {n for n in set(sys.modules) - before if n.startswith("_clef_release_")}


def test_failing_load_fails_startup(make_snapshot: MakeSnapshot) -> None:
    source = FORM_A.replace("    LOADED.update(",
                            "    raise OSError('no weights')\n    LOADED.update(")
    with pytest.raises(StartupError, match="no weights"):
        _load(make_snapshot(source))


def test_two_snapshots_do_not_share_a_module(make_snapshot: MakeSnapshot) -> None:
    first = _load(make_snapshot(FORM_A, "a"))
    first_module = _module(first)
    second = _load(make_snapshot(FORM_A, "b"))
    second_module = _module(second)
    assert first_module is not second_module
    second.answer(_body(VALID))
    assert first_module.CALLS == []
    assert len(second_module.CALLS) == 1


def test_fla_is_blocked_before_the_release_module_imports(make_snapshot: MakeSnapshot) -> None:
    """transformers binds its Gated DeltaNet kernel when the release imports it: on CPU the
    guard must already be in place at that moment. In a fresh interpreter, so that no earlier
    test's imports or blocks decide the outcome (and none leak out of this one)."""
    source = "import sys\nFLA_AT_IMPORT = sys.modules.get('fla', 'absent')\n" + FORM_A
    snapshot = make_snapshot(source)
    code = textwrap.dedent(f"""
        import sys
        assert "fla" not in sys.modules
        from clef_protocol.options import RequestLimits
        from clef_worker.release import ReleaseExecutor
        executor = ReleaseExecutor.load({str(snapshot)!r}, variant="clef-flash", device="cpu",
                                        dtype="float32", gdn_prefill="auto",
                                        limits=RequestLimits())
        print(executor.upstream_module.FLA_AT_IMPORT, executor.describe().gdn_path)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "torch"]  # blocked (None), not 'absent'


def test_fla_prefill_needs_cuda(make_snapshot: MakeSnapshot) -> None:
    with pytest.raises(StartupError, match="gdn-prefill fla"):
        ReleaseExecutor.load(
            make_snapshot(FORM_A), variant="clef-flash", device="cpu", dtype="float32",
            gdn_prefill="fla", limits=RequestLimits(),
        )


def test_snapshot_is_checked_before_its_code_runs(make_snapshot: MakeSnapshot) -> None:
    snapshot = make_snapshot("raise SystemExit('upstream code ran')\n")
    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(StartupError, match=r"tokenizer\.json"):
        _load(snapshot)


# A stand-in loading the backbone as the release does: from_pretrained with a device_map.
FORM_DEVICE_MAP = '''
from transformers import AutoModelForCausalLM


def load_release_model(snapshot_dir, device=None, dtype=None):
    return AutoModelForCausalLM.from_pretrained(snapshot_dir, device_map=device, dtype=dtype), None


def systemone(model, processor, request):
    return {"model": request["model"], "answers": {}, "device": str(model.device),
            "usage": {"input_tokens": 0, "output_tokens": 0}}
'''


def test_release_extra_loads_with_a_device_map(make_snapshot: MakeSnapshot) -> None:
    """The documented environment (pip install 'clef-serve[release]', which CI installs through
    the dev extra) has what the release's device_map loading needs."""
    executor = _load(make_snapshot(FORM_DEVICE_MAP))
    assert json.loads(executor.answer(_body(VALID)).body)["device"] == "cpu"


def test_missing_release_extra_fails_startup_clearly(make_snapshot: MakeSnapshot,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(StartupError, match=r"pip install 'clef-serve\[release\]'"):
        _load(make_snapshot(FORM_A))
