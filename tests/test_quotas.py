"""Named keys with quotas: the TOML key file, the token bucket's Retry-After, and 429s through a
real front (other keys unaffected, the Workers-AI envelope on that route, metrics by key name)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from clef_frontend.auth import ApiKeys, KeyFileError, NamedKey, load_key_file
from clef_frontend.quotas import Quotas
from tests.frontend_helpers import Serve, clef_body
from tests.traffic_helpers import metric

INGEST_KEY = "sk-ingest-5b1e0c"
ROUTER_KEY = "sk-router-93d2aa"
HASHED_KEY = "sk-hashed-0f0f0f"
RUN = "/accounts/acct/ai/run/@cf/cloudflare/clef-flash"
KEYS_TOML = f"""
[keys.rag-ingest]
key = "{INGEST_KEY}"
rate = 0.5
burst = 2
priority = "bulk"

[keys.router]
key = "{ROUTER_KEY}"

[keys.evals]
key_sha256 = "{hashlib.sha256(HASHED_KEY.encode()).hexdigest()}"
rate = 100
"""


def bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


def test_named_keys_are_read_with_their_quota_and_class(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_TOML)
    ingest, router, evals = load_key_file(path)
    assert (ingest.name, ingest.rate, ingest.burst, ingest.priority) == \
        ("rag-ingest", 0.5, 2.0, "bulk")
    assert (router.name, router.rate, router.priority) == ("router", None, "interactive")
    assert (evals.name, evals.rate, evals.burst) == ("evals", 100.0, 100.0)  # burst: the rate
    keys = ApiKeys(path)
    assert keys.identify(f"Bearer {HASHED_KEY}".encode()) == evals  # the file holds no secret
    assert keys.identify(f"Bearer {ROUTER_KEY}".encode()) == router
    assert keys.identify(b"Bearer nobody") is None


@pytest.mark.parametrize(("text", "message"), [
    ("[keys.a]\nrate = 1\n", "exactly one of key and key_sha256"),
    ('[keys.a]\nkey = "x"\nkey_sha256 = "ab"\n', "exactly one of key and key_sha256"),
    ('[keys.a]\nkey_sha256 = "abc"\n', "64 hex digits"),
    ('[keys.a]\nkey = "x"\nrate = -1\n', "rate must be a positive number"),
    ('[keys.a]\nkey = "x"\nburst = 3\n', "burst without rate"),
    ('[keys.a]\nkey = "x"\npriority = "urgent"\n', "priority 'urgent' is not one of"),
    ('[keys.a]\nkey = "x"\nrates = 3\n', "unknown fields ['rates']"),
    ('[keys."a b"]\nkey = "x"\n', "must be 1-64 letters"),
    ('[keys.a]\nkey = "x"\n[keys.b]\nkey = "x"\n', "keys.b has the same key as keys.a"),
    ("[keys]\n", "holds no key"),
    ("keys = [", "not valid TOML"),
])
def test_a_bad_named_key_file_says_what_is_wrong_and_never_the_key(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=r"keys\.toml") as refused:
        load_key_file(path)
    assert message in str(refused.value)
    assert '"x"' not in str(refused.value)


def test_retry_after_is_the_whole_seconds_until_a_retry_succeeds() -> None:
    quotas = Quotas()
    key = NamedKey("k", b"d", rate=0.4, burst=2.0)
    assert quotas.check(key, now=100.0) is None
    assert quotas.check(key, now=100.0) is None  # the burst
    refusal = quotas.check(key, now=100.5)
    assert refusal is not None and refusal.status == 429
    wait = refusal.retry_after
    assert wait == math.ceil((1 - 0.5 * 0.4) / 0.4) == 2  # 0.2 tokens; 0.8 more at 0.4/s
    assert quotas.check(key, now=100.5 + wait - 0.01) is not None or wait == 1
    assert quotas.check(key, now=100.5 + wait) is None  # the retry it was told to make works
    fast = NamedKey("f", b"e", rate=50.0, burst=1.0)
    assert quotas.check(fast, now=0.0) is None
    refused = quotas.check(fast, now=0.0)
    assert refused is not None and refused.retry_after == 1  # never 0: at least one second
    assert quotas.check(NamedKey("free", b"g"), now=0.0) is None  # no rate: no limit


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Serve]:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_TOML)
    with Serve(front_args=("--api-key-file", str(path))) as server:
        yield server
    for key in (INGEST_KEY, ROUTER_KEY, HASHED_KEY):
        assert key not in server.stderr


def test_a_key_over_its_rate_gets_429_and_other_keys_do_not(keyed: Serve) -> None:
    assert [keyed.post(clef_body(tag=str(i)), headers=bearer(INGEST_KEY)).status
            for i in range(2)] == [200, 200]  # the burst
    refused = keyed.post(clef_body(tag="over"), headers=bearer(INGEST_KEY))
    assert refused.status == 429
    assert refused.detail == ("key 'rag-ingest' is over its quota of 0.5 requests per second "
                              "(burst 2)")
    assert refused.header("Retry-After") in ("1", "2")  # whole seconds, at least 1
    run = keyed.request("POST", RUN, clef_body(tag="run"), headers=bearer(INGEST_KEY))
    assert run.status == 429 and run.header("Retry-After") is not None
    assert run.json() == {"result": None, "success": False, "messages": [], "errors": [
        {"code": 429, "message": refused.detail}]}
    # Another key is unaffected, however many requests the first one sends.
    assert [keyed.post(clef_body(tag=f"r{i}"), headers=bearer(ROUTER_KEY)).status
            for i in range(5)] == [200] * 5
    assert metric(keyed, "clef_quota_refusals_total", key="rag-ingest") == 2
    assert metric(keyed, "clef_quota_refusals_total", key="router") == 0
    assert metric(keyed, "clef_http_requests_total", route="/v1/systemone", status="429",
                  key="rag-ingest") == 1
    assert metric(keyed, "clef_http_requests_total", route="/v1/systemone", status="200",
                  key="router") == 5
    keyed.wait_for(r"status=429 .*key=rag-ingest ")  # names, never keys, in the access log
    keyed.wait_for(r"status=200 .*key=router ")
