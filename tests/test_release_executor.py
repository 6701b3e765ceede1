"""`--executor release` around the release's real `joint_schema_model.py` (tests/upstream.py).

The tiny fixture snapshot with the upstream file copied in is what a downloaded release looks
like. The release's loader builds Qwen3-VL's processor, which needs a torchvision built for the
installed torch; the CPU torch wheel has none, so these tests (but the one that checks that
failure) give the loader a processor holding only the snapshot's tokenizer: everything a text
request touches is the release's own code.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchlib.golden import answered, assert_response_matches, refused
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.options import RequestLimits
from clef_worker.errors import ExecutorBroken, StartupError
from clef_worker.model.encoding import BUDGET, Encoder
from clef_worker.model.module_names import MODELING_MODULE
from clef_worker.release import RELEASE_FILE, ReleaseExecutor
from clef_worker.starting import warmup
from tests.conftest import REPO
from tests.upstream import (
    UPSTREAM_SHA256,
    release_snapshot,
    sha256,
    upstream_file,
    use_text_only_processor,
)

VALID = {"model": "m", "state": "hello", "questions": {"q": {"type": "noul"}}}
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def snapshot(tiny_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return release_snapshot(tiny_snapshot, tmp_path_factory.mktemp("release") / "snapshot")


def _load(snapshot: Path, limits: RequestLimits | None = None, gdn_prefill: str = "torch",
          device: str = "cpu") -> ReleaseExecutor:
    return ReleaseExecutor.load(snapshot, variant="clef-flash", device=device, dtype="float32",
                                gdn_prefill=gdn_prefill, limits=limits or RequestLimits())


@pytest.fixture(scope="module")
def executor(snapshot: Path) -> Iterator[ReleaseExecutor]:
    with pytest.MonkeyPatch.context() as patch:
        use_text_only_processor(patch)
        yield _load(snapshot)


@pytest.fixture
def encodes(executor: ReleaseExecutor, monkeypatch: pytest.MonkeyPatch
            ) -> list[tuple[dict[str, Any], int]]:
    """Every `(request, max_length)` the release's `systemone` goes on to encode."""
    module = executor.upstream_module
    real = module.encode_record
    seen: list[tuple[dict[str, Any], int]] = []

    def recorded(tokenizer: Any, record: dict[str, Any], max_length: int = 16384,
                 **kwargs: Any) -> Any:
        seen.append((copy.deepcopy(record), max_length))
        return real(tokenizer, record, max_length=max_length, **kwargs)

    monkeypatch.setattr(module, "encode_record", recorded)
    return seen


def _body(request: object) -> bytes:
    return json.dumps(request).encode()


def test_the_upstream_file_is_the_release_s() -> None:
    assert sha256(upstream_file()) == UPSTREAM_SHA256


def test_the_cpu_wheel_cannot_build_the_release_s_processor(snapshot: Path) -> None:
    """What the CPU torch wheel allows: without a torchvision for it the release cannot start,
    and the start-up error says what is missing."""
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the processor may build")
    with pytest.raises(StartupError, match=r"load_release_model\(\) failed: ImportError: .*"
                                           r"[Tt]orchvision.*torchvision built for the installed"):
        _load(snapshot)


@pytest.mark.parametrize("case", answered(), ids=lambda case: case["name"])
def test_golden_answers(executor: ReleaseExecutor, case: dict[str, Any]) -> None:
    """The release's code answers every golden case as the golden file says, through this
    executor's validation, limits and serialisation."""
    answer = executor.with_limits(RequestLimits(max_length=case["max_length"])).answer(
        _body(case["request"]))
    assert_response_matches(json.loads(answer.body), case["response"])
    assert answer.input_tokens == len(case["input_ids"])


@pytest.mark.parametrize("case", refused(), ids=lambda case: case["name"])
def test_golden_refusals(executor: ReleaseExecutor, case: dict[str, Any]) -> None:
    with pytest.raises(RequestInvalid) as refusal:
        executor.with_limits(RequestLimits(max_length=case["max_length"])).answer(
            _body(case["request"]))
    assert str(refusal.value) == case["error"]["message"]


def test_describe(executor: ReleaseExecutor, snapshot: Path) -> None:
    info = executor.describe()
    assert (info.device, info.dtype, info.gdn_path) == ("cpu", "float32", "torch")
    assert info.snapshot == str(snapshot)
    assert info.versions[RELEASE_FILE] == UPSTREAM_SHA256[:16]


def test_answers_are_utf8_and_limits_reach_upstream(
        executor: ReleaseExecutor, encodes: list[tuple[dict[str, Any], int]]) -> None:
    request = {**VALID, "questions": {"é": {"type": "noul"}}}
    body = executor.with_limits(RequestLimits(max_length=4096)).answer(_body(request)).body
    assert "é" in body.decode("utf-8")  # UTF-8, not \u escapes
    assert encodes == [(request, 4096)]


def test_warm_up_goes_through_upstream(executor: ReleaseExecutor, snapshot: Path,
                                       encodes: list[tuple[dict[str, Any], int]]) -> None:
    executor.warm_up()
    assert encodes == [(warmup.REPRESENTATIVE, RequestLimits().max_length)]


def test_warm_up_fits_a_short_max_length(snapshot: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """A --max-length that no request fits starts anyway and never calls upstream; a short one
    warms up on a smaller request that fits."""
    use_text_only_processor(monkeypatch)
    calls: list[tuple[dict[str, Any], int]] = []
    for max_length in (64, 200):
        executor = _load(snapshot, RequestLimits(max_length=max_length))
        module = executor.upstream_module
        real = module.encode_record

        def recorded(tokenizer: Any, record: dict[str, Any], *, real: Any = real,
                     **kwargs: Any) -> Any:
            calls.append((record, kwargs["max_length"]))
            return real(tokenizer, record, **kwargs)

        monkeypatch.setattr(module, "encode_record", recorded)
        executor.warm_up()
    ((request, max_length),) = calls
    assert max_length == 200 and request != warmup.REPRESENTATIVE


@pytest.mark.parametrize("request_", [
    {"state": "x", "questions": {"q": {"type": "noul"}}},
    {"model": "m", "state": "x", "questions": {}},
    {"model": "m", "state": "x", "questions": {"q": {"type": "maybe"}}},
    {"model": "m", "state": "x", "questions": {"q": "not an object"}},
    {"model": "m", "state": "x", "questions": {"q": {"type": "choice", "criteria": ["a"]}}},
    {"model": "m", "state": "x", "questions": {"q": {"type": "noul"}}, "images": ["x.png"]},
])
def test_invalid_requests_never_reach_upstream(
        executor: ReleaseExecutor, encodes: list[tuple[dict[str, Any], int]],
        request_: dict[str, Any]) -> None:
    with pytest.raises(RequestInvalid):
        executor.answer(_body(request_))
    assert encodes == []


def test_unparsable_body_is_a_bad_request(executor: ReleaseExecutor,
                                          encodes: list[tuple[dict[str, Any], int]]) -> None:
    with pytest.raises(BadRequestBody):
        executor.answer(b'{"model": "m", "model": "n"}')
    assert encodes == []


def test_the_budget_refusal_is_upstream_s_and_a_422(
        executor: ReleaseExecutor, snapshot: Path,
        encodes: list[tuple[dict[str, Any], int]]) -> None:
    """Check 4 is left to the release: its ValueError becomes a 422 with its text, which is the
    text this project's encoder gives for the same request."""
    limits = RequestLimits(max_length=100)
    with pytest.raises(RequestInvalid) as refusal:
        executor.with_limits(limits).answer(_body(VALID))
    assert encodes == [(VALID, 100)]
    with pytest.raises(RequestInvalid) as ours:
        Encoder.from_file(snapshot / "tokenizer.json").encode(VALID, 100)
    assert str(refusal.value) == str(ours.value)
    assert str(refusal.value).startswith(BUDGET.split("{")[0])


def _failing(monkeypatch: pytest.MonkeyPatch, executor: ReleaseExecutor,
             error: BaseException) -> None:
    """The release's encoder raises `error` (an upstream failure inside `systemone`)."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(executor.upstream_module, "encode_record", fail)


def test_an_internal_value_error_is_not_a_422(executor: ReleaseExecutor,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the reference's own refusal texts become 422; anything else stays a 500."""
    _failing(monkeypatch, executor, ValueError("expected 2D input, got shape [3, 4, 5]"))
    with pytest.raises(ValueError, match="expected 2D input") as caught:
        executor.answer(_body(VALID))
    assert not isinstance(caught.value, RequestInvalid)


def test_other_upstream_errors_are_not_422(executor: ReleaseExecutor,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _failing(monkeypatch, executor, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        executor.answer(_body(VALID))


def _on_cuda(executor: ReleaseExecutor) -> ReleaseExecutor:
    """The loaded release as if its device were a GPU (this machine has none): only the
    executor's classification of errors reads the device."""
    return type(executor)(module=executor.upstream_module, model=executor.model,
                          processor=executor.processor, info=executor.describe(),
                          limits=RequestLimits(), device=torch.device("cuda", 0),
                          policy=executor.policy)


@pytest.mark.parametrize("error", [
    torch.AcceleratorError(ILLEGAL_ACCESS),
    RuntimeError("CUDA error: device-side assert triggered"),
])
def test_a_sticky_cuda_error_breaks_the_executor(
        executor: ReleaseExecutor, monkeypatch: pytest.MonkeyPatch,
        error: BaseException) -> None:
    """A CUDA error inside the release's forward poisons the context: ExecutorBroken (the worker
    exits and is replaced) instead of a 500 on every later request while /health says ready."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(executor.model, "forward", forward)
    with pytest.raises(ExecutorBroken, match="CUDA error") as caught:
        _on_cuda(executor).answer(_body(VALID))
    assert caught.value.__cause__ is error
    with pytest.raises(type(error)):  # the same error on a CPU device is one failed request
        executor.answer(_body(VALID))


def test_out_of_memory_does_not_break_the_executor(executor: ReleaseExecutor,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _failing(monkeypatch, executor, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        _on_cuda(executor).answer(_body(VALID))


MakeSnapshot = Callable[[str], Path]


@pytest.fixture
def broken_snapshot(snapshot: Path, tmp_path: Path) -> MakeSnapshot:
    """A copy of the release snapshot whose joint_schema_model.py says `source` instead."""

    def make(source: str, name: str = "broken") -> Path:
        copy_dir = release_snapshot(snapshot, tmp_path / name)
        (copy_dir / RELEASE_FILE).write_text(textwrap.dedent(source))
        return copy_dir

    return make


def test_missing_file_fails_startup(snapshot: Path, tmp_path: Path) -> None:
    bare = release_snapshot(snapshot, tmp_path / "bare")
    (bare / RELEASE_FILE).unlink()
    with pytest.raises(StartupError, match=f"{RELEASE_FILE} not found"):
        _load(bare)


def test_a_file_without_the_interface_fails_startup(broken_snapshot: MakeSnapshot) -> None:
    with pytest.raises(StartupError, match="lacks load_release_model"):
        _load(broken_snapshot("def score(request):\n    return {}\n"))


def test_import_error_fails_startup_and_unregisters(broken_snapshot: MakeSnapshot) -> None:
    before = set(sys.modules)
    with pytest.raises(StartupError, match="ZeroDivisionError"):
        _load(broken_snapshot("x = 1 / 0\n"))
    assert not {n for n in set(sys.modules) - before if n.startswith("_clef_release_")}


def test_a_failing_loader_fails_startup(broken_snapshot: MakeSnapshot) -> None:
    source = upstream_file().read_text() + (
        "\n\ndef load_release_model(*args, **kwargs):\n    raise OSError('no weights')\n")
    with pytest.raises(StartupError, match=r"load_release_model\(\) failed: OSError: no weights"):
        _load(broken_snapshot(source))


def test_two_snapshots_do_not_share_a_module(snapshot: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    use_text_only_processor(monkeypatch)
    first = _load(release_snapshot(snapshot, tmp_path / "a"))
    second = _load(release_snapshot(snapshot, tmp_path / "b"))
    assert first.upstream_module is not second.upstream_module
    assert first.upstream_module.__name__ != second.upstream_module.__name__


def test_snapshot_is_checked_before_its_code_runs(broken_snapshot: MakeSnapshot) -> None:
    snapshot = broken_snapshot("raise SystemExit('upstream code ran')\n")
    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(StartupError, match=r"tokenizer\.json"):
        _load(snapshot)


def test_fla_prefill_needs_cuda(snapshot: Path) -> None:
    with pytest.raises(StartupError, match="gdn-prefill fla"):
        _load(snapshot, gdn_prefill="fla")


def test_fla_is_blocked_before_the_release_imports_transformers(snapshot: Path) -> None:
    """transformers binds its Gated DeltaNet kernel when the release's loader first imports its
    Qwen3.5 module: on CPU the block must be in place at that moment. In a fresh interpreter
    (no earlier import decides the outcome), an import hook records what `fla` was then."""
    code = textwrap.dedent(f"""
        import sys
        seen = []

        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name == {MODELING_MODULE!r}:
                    seen.append(repr(sys.modules.get("fla", "absent")))
                return None

        sys.meta_path.insert(0, Watch())
        import pytest
        from clef_protocol.options import RequestLimits
        from clef_worker.release import ReleaseExecutor
        from tests.upstream import use_text_only_processor

        with pytest.MonkeyPatch.context() as patch:
            use_text_only_processor(patch)
            executor = ReleaseExecutor.load({str(snapshot)!r}, variant="clef-flash",
                                            device="cpu", dtype="float32", gdn_prefill="auto",
                                            limits=RequestLimits())
        print(seen, executor.describe().gdn_path)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["['None']", "torch"]  # blocked (None), not 'absent'


def test_missing_release_extra_fails_startup_clearly(snapshot: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(StartupError, match=r"pip install 'clef-serve\[release\]'"):
        _load(snapshot)
