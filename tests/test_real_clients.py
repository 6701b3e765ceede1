"""The Clef clients published on the registry, unmodified, against clef-serve on the demo snapshot.

Each client is installed by the `test` extra (in `dev` too) and run the way its README says: the
CLIs as subprocesses, clef-router as a library. The demo model's answers are random, so the tests
assert what a working integration guarantees: exit codes, no errors, and an answer for every
question, never the values. The server requires keys (one from `--api-key-file`, one from
`CLEF_API_KEY`), so every client also proves it authenticates, and none of the keys may reach the
server's log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.frontend_helpers import Serve

FILE_KEY = "clients-file-key-5b7d1e"
ENV_KEY = "clients-env-key-c3a9f0"
CLIENT_TIMEOUT = 300.0  # the demo model on a shared CPU; a bound, not a synchronisation
RUN_LIMIT = 600.0


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(FILE_KEY + "\n")
    previous = os.environ.get("CLEF_API_KEY")
    os.environ["CLEF_API_KEY"] = ENV_KEY
    try:
        server = Serve(real_worker=True, startup_wait=600,
                       front_args=("--model", "demo", "--device", "cpu",
                                   "--api-key-file", str(keys)))
    finally:
        if previous is None:
            del os.environ["CLEF_API_KEY"]
        else:
            os.environ["CLEF_API_KEY"] = previous
    with server:
        yield server
    for key in (FILE_KEY, ENV_KEY):
        assert key not in server.stderr


def script(name: str) -> str:
    """A console script installed next to this interpreter's packages."""
    found = shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' installs the Clef clients")
    return found


def client_env(demo: Serve, **extra: str) -> dict[str, str]:
    """The environment a user would set, without anything of this test run's own CLEF_*."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("CLEF_", "CLOUDFLARE_"))}
    env.update(CLEF_BASE_URL=f"http://127.0.0.1:{demo.port}", **extra)
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_LIMIT, stdin=subprocess.DEVNULL)


def workers_ai_env(demo: Serve, token: str) -> dict[str, str]:
    return client_env(demo, CLEF_ACCOUNT_ID="local-account", CLEF_API_TOKEN=token,
                      CLEF_TIMEOUT=str(CLIENT_TIMEOUT), CLEF_MAX_RETRIES="0")


# -- clef-evals ----------------------------------------------------------------------------------

EVAL_SET = [
    {"state": "The customer paid invoice 4411 twice and asks for the duplicate back.",
     "instructions": "Does the customer ask for a refund?", "gold": True},
    {"state": "The parcel arrived two days late and the box was crushed.",
     "instructions": "What is the ticket about?", "gold": "delivery",
     "criteria": {"billing": "Payments and refunds", "delivery": "Shipping and delivery",
                  "other": "Anything else"}},
    {"state": "Thanks, the new password works.", "instructions": "Is the customer angry?",
     "gold": False},
    {"state": "Please close my account today.", "instructions": "Which team handles this?",
     "gold": "accounts", "choices": ["accounts", "billing", "shipping"]},
]


def test_clef_eval_run(demo: Serve, tmp_path: Path) -> None:
    dataset = tmp_path / "tickets.jsonl"
    dataset.write_text("".join(json.dumps(item) + "\n" for item in EVAL_SET))
    env = workers_ai_env(demo, FILE_KEY)
    done = run([script("clef-eval"), "run", str(dataset), "--model", "@cf/cloudflare/clef-flash",
                "--json", "--concurrency", "2", "--quiet"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["failures"] == 0 and result["gate_passed"] is True
    assert result["n_samples"] == len(EVAL_SET)
    assert len(result["predictions"]) == len(EVAL_SET)
    assert all(prediction is not None for prediction in result["predictions"])
    assert all(0.0 <= confidence <= 1.0 for confidence in result["confidences"])
    assert result["input_tokens"] > 0


def test_clef_eval_reports_a_wrong_key(demo: Serve, tmp_path: Path) -> None:
    dataset = tmp_path / "one.json"
    dataset.write_text(json.dumps(EVAL_SET[:1]))
    done = run([script("clef-eval"), "run", str(dataset), "--model", "@cf/cloudflare/clef-flash",
                "--quiet"], workers_ai_env(demo, "not-a-key"), tmp_path)
    # The client reads the 401 envelope as an API error for that item and fails its gate.
    assert done.returncode == 1
    assert "1 item(s) failed with API errors" in done.stdout
    demo.wait_for(r"path=/accounts/local-account/ai/run/@cf/cloudflare/clef-flash status=401")


# -- clef-compactor ------------------------------------------------------------------------------

CHUNKS = [
    "Refunds are issued within 14 days of purchase.",
    "Our office is closed on Sundays and public holidays.",
    "Duplicate card charges are refunded automatically within a week.",
    "The cafeteria serves lunch from noon.",
]


def test_clef_compact_scores_every_chunk(demo: Serve, tmp_path: Path) -> None:
    env = workers_ai_env(demo, FILE_KEY)
    env["TIKTOKEN_CACHE_DIR"] = str(tmp_path / "tiktoken")  # offline: it falls back to words
    done = run([script("clef-compact"), "-q", "how do refunds work", "-d", *CHUNKS,
                "--budget", "20", "--model", "clef-flash", "--retries", "0",
                "--timeout", str(CLIENT_TIMEOUT), "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert sorted(score["index"] for score in result["scores"]) == list(range(len(CHUNKS)))
    assert all(0.0 <= score["score"] <= 1.0 for score in result["scores"])
    assert len(result["kept"]) + len(result["dropped"]) == len(CHUNKS)
    assert result["usage"]["input_tokens"] > 0


# -- clef-router ---------------------------------------------------------------------------------


def test_clef_router_decides(demo: Serve) -> None:
    from clef_router import ClefRouter
    from clef_router.models import DEFAULT_QUESTIONS

    router = ClefRouter(account_id="local-account", api_token=ENV_KEY,
                        base_url=f"http://127.0.0.1:{demo.port}", model_selector="clef-flash",
                        timeout=CLIENT_TIMEOUT, max_retries=0)
    with router:
        routing = router.route("Design a rate limiter with exact global quotas across regions.",
                               system_prompt="Send hard engineering questions to frontier.")
        decision = router.decide({"ticket": "My invoice is wrong"})
    assert routing.tier in ("cheap", "frontier")
    assert set(routing.decision.answers) == set(DEFAULT_QUESTIONS)
    assert set(decision.answers) == set(DEFAULT_QUESTIONS)
    assert decision.usage.input_tokens > 0


# -- clef-rag (self-hosted backend: POST /v1/systemone) -------------------------------------------

RAG_CONFIG = f"""\
clef:
  backend: self-hosted
  model: clef-flash
  cache_dir: .clef-rag/cache
  timeout_s: {CLIENT_TIMEOUT}
  max_retries: 0
store:
  kind: memory
  path: .clef-rag/memory-store.json
embedder:
  model: hash:64
"""

DOCUMENT = """\
# Refunds

Refunds are issued within 14 days of purchase. Duplicate charges are refunded automatically.

# Shipping

Parcels ship within two business days. Damaged boxes can be returned for free.
"""


def rag(demo: Serve, tmp_path: Path, *args: str, key: str = ENV_KEY
        ) -> subprocess.CompletedProcess[str]:
    env = client_env(demo, CLEF_API_KEY=key)
    return run([script("clef-rag"), "--no-env-file", *args], env, tmp_path)


def _json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_clef_rag_check_ingest_query_with_a_key(demo: Serve, tmp_path: Path) -> None:
    (tmp_path / "clef-rag.yaml").write_text(RAG_CONFIG)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "policy.md").write_text(DOCUMENT)

    check = rag(demo, tmp_path, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "backend=self-hosted" in check.stdout and "FAILED" not in check.stdout

    ingest = _json(rag(demo, tmp_path, "ingest", "docs", "--collection", "kb", "--json"))
    assert ingest["clef"]["errors"] == 0 and ingest["clef"]["requests"] > 0
    assert [doc["status"] for doc in ingest["docs"]] == ["ingested"]
    assert ingest["docs"][0]["error"] is None

    query = _json(rag(demo, tmp_path, "query", "how long do refunds take", "--collection", "kb",
                      "--json"))
    assert query["trace"]["clef"]["errors"] == 0 and query["trace"]["clef"]["requests"] > 0
    assert query["trace"]["classify"]["errors"] == 0
    assert query["degraded"] is False


def test_clef_rag_check_fails_with_a_wrong_key(demo: Serve, tmp_path: Path) -> None:
    (tmp_path / "clef-rag.yaml").write_text(RAG_CONFIG)
    check = rag(demo, tmp_path, "check", key="not-a-key")
    assert check.returncode != 0
    assert "FAILED" in check.stdout and "401" in check.stdout + check.stderr
