"""Bearer keys: the checks alone, then through clef-serve (file and environment keys, 401 before
the body is read, rotation when the file changes, no key in any log line)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clef_frontend.auth import ApiKeys, KeyFileError, read_key_file
from tests.frontend_helpers import Serve, build_request, clef_body

FILE_KEY = "file-key-4f9c0d2e7b"
SECOND_FILE_KEY = "second-file-key-a1b2c3"
ROTATED_KEY = "rotated-key-77e1d0c9"
ENV_KEY = "env-key-0d8e5b3a61"
WRONG_KEY = "wrong-key-9999"
ALL_KEYS = (FILE_KEY, SECOND_FILE_KEY, ROTATED_KEY, ENV_KEY, WRONG_KEY)
RUN = "/accounts/acct/ai/run/@cf/cloudflare/clef-flash"


def bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


# -- the checks alone --------------------------------------------------------------------------


def test_key_file_lines_comments_and_blanks(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# rotated monthly\n\n  {FILE_KEY}  \n{SECOND_FILE_KEY}\n")
    assert read_key_file(path) == (FILE_KEY, SECOND_FILE_KEY)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_a_key_file_without_keys_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyFileError, match="holds no key"):
        read_key_file(path)


def test_a_missing_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read it"):
        ApiKeys(tmp_path / "absent")


@pytest.mark.parametrize(("header", "allowed"), [
    (f"Bearer {FILE_KEY}".encode(), True),
    (f"bearer {ENV_KEY}".encode(), True),
    (f"BEARER   {FILE_KEY}  ".encode(), True),
    (f"Bearer {WRONG_KEY}".encode(), False),
    (f"Bearer {FILE_KEY}x".encode(), False),
    (f"Bearer {FILE_KEY[:-1]}".encode(), False),
    (f"Basic {FILE_KEY}".encode(), False),
    (FILE_KEY.encode(), False),
    (b"Bearer", False),
    (b"Bearer ", False),
    (b"", False),
    (None, False),
])
def test_bearer_check(tmp_path: Path, header: bytes | None, allowed: bool) -> None:
    path = tmp_path / "keys"
    path.write_text(FILE_KEY + "\n")
    keys = ApiKeys(path, ENV_KEY)
    assert keys.enabled and keys.count == 2
    assert keys.allows(header) is allowed
    refusal = keys.check(header)
    if allowed:
        assert refusal is None
    else:
        assert refusal is not None and refusal.status == 401
        assert ("WWW-Authenticate", "Bearer") in refusal.headers(close=False)


def test_without_keys_any_header_passes() -> None:
    keys = ApiKeys(None, None)
    assert not keys.enabled
    assert keys.allows(None) and keys.allows(b"Bearer whatever") and keys.allows(b"junk")


def test_failed_reload_keeps_the_keys_in_force(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(FILE_KEY + "\n")
    keys = ApiKeys(path)
    path.write_text(ROTATED_KEY + "\n")
    keys.reload()
    assert keys.allows(f"Bearer {ROTATED_KEY}".encode())
    assert not keys.allows(f"Bearer {FILE_KEY}".encode())
    path.write_text("")
    keys.reload()
    assert keys.allows(f"Bearer {ROTATED_KEY}".encode())
    path.unlink()
    keys.reload()
    assert keys.allows(f"Bearer {ROTATED_KEY}".encode())


# -- through the server --------------------------------------------------------------------------


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text(f"{FILE_KEY}\n{SECOND_FILE_KEY}\n")
    return path


@pytest.fixture
def keyed(key_file: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Serve]:
    monkeypatch.setenv("CLEF_API_KEY", ENV_KEY)
    with Serve(front_args=("--api-key-file", str(key_file))) as server:
        yield server
    for key in ALL_KEYS:  # keys never reach a log line, whatever happened in the test
        assert key not in server.stderr


@pytest.mark.parametrize("headers", [[], bearer(WRONG_KEY), [("Authorization", "Basic abc")]])
def test_missing_or_wrong_key_is_401(keyed: Serve, headers: list[tuple[str, str]]) -> None:
    plain = keyed.post(clef_body(), headers=headers)
    assert plain.status == 401
    assert plain.json() == {"detail": "missing or invalid API key"}
    assert plain.header("WWW-Authenticate") == "Bearer"
    run = keyed.request("POST", RUN, clef_body(), headers=headers)
    assert (run.status, run.header("WWW-Authenticate")) == (401, "Bearer")
    assert run.json() == {"result": None, "success": False, "messages": [],
                          "errors": [{"code": 401, "message": "missing or invalid API key"}]}
    models = keyed.request("GET", "/v1/models", headers=headers)
    assert models.status == 401


@pytest.mark.parametrize("key", [FILE_KEY, SECOND_FILE_KEY, ENV_KEY])
def test_each_configured_key_is_accepted(keyed: Serve, key: str) -> None:
    assert keyed.post(clef_body(), headers=bearer(key)).status == 200
    run = keyed.request("POST", RUN, clef_body(), headers=bearer(key))
    assert run.status == 200 and run.json()["success"] is True
    models = keyed.request("GET", "/v1/models", headers=bearer(key))
    assert models.status == 200 and models.json()["data"][0]["id"] == "clef-flash"


def test_health_stays_open_for_probes(keyed: Serve) -> None:
    assert keyed.health().status == 200


def test_401_comes_before_the_body_is_read(keyed: Serve) -> None:
    head = build_request("POST", "/v1/systemone", b"x" * 100_000)[:-100_000]
    with keyed.connect() as client:
        client.send_raw(head)  # the body never comes: the answer must not wait for it
        response = client.read_response()
        assert response.status == 401
        assert response.header("Connection") == "close"
        assert client.at_eof()


def test_a_rewritten_key_file_rotates_the_keys_without_a_signal(keyed: Serve,
                                                                key_file: Path) -> None:
    assert keyed.post(clef_body(), headers=bearer(FILE_KEY)).status == 200
    key_file.write_text(f"# rotated\n{ROTATED_KEY}\n")
    keyed.wait_for(r"API keys reloaded from .*: 2 key\(s\) in force")
    assert keyed.post(clef_body(), headers=bearer(FILE_KEY)).status == 401
    assert keyed.post(clef_body(), headers=bearer(ROTATED_KEY)).status == 200
    assert keyed.post(clef_body(), headers=bearer(ENV_KEY)).status == 200  # the environment's

    key_file.write_text("\n")  # a botched rotation keeps the keys in force
    keyed.wait_for(r"API keys not reloaded, 2 key\(s\) stay in force: .*holds no key")
    assert keyed.post(clef_body(), headers=bearer(ROTATED_KEY)).status == 200
    assert keyed.health().json()["status"] == "ready"


def test_without_keys_authorization_is_ignored() -> None:
    with Serve() as server:
        assert server.post(clef_body(), headers=bearer(WRONG_KEY)).status == 200
        assert server.post(clef_body(), headers=[("Authorization", "junk")]).status == 200
        assert server.request("GET", "/v1/models").status == 200


@pytest.mark.parametrize(("text", "message"), [
    (None, "cannot read it"), ("# no keys yet\n", "holds no key"),
])
def test_an_unusable_key_file_stops_start_up(tmp_path: Path, text: str | None,
                                             message: str) -> None:
    path = tmp_path / "keys"
    if text is not None:
        path.write_text(text)
    server = Serve(front_args=("--api-key-file", str(path)), wait_listening=False)
    try:
        assert server.wait_exit() == 2
        assert f"--api-key-file {path}: {message}" in server.stderr
    finally:
        server.close()
