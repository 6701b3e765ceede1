"""Key rotation without a warm-up: the key file is re-read when it changes (a rewrite, or a
Kubernetes Secret's symlink swap), with no signal and without touching a worker; a bad new file
keeps the keys in force. SIGHUP keeps one job: rolling the workers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from clef_frontend.auth import ApiKeys
from tests.frontend_helpers import Serve, clef_body
from tests.traffic_helpers import wait_until

OLD_KEY = "sk-old-1c2d3e"
NEW_KEY = "sk-new-9f8e7d"


def bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


def named(name: str, key: str) -> str:
    return f'[keys.{name}]\nkey = "{key}"\n'


def secret_volume(root: Path, text: str) -> Path:
    """A directory laid out as Kubernetes mounts a Secret: `keys.toml -> ..data/keys.toml`,
    `..data -> ..<timestamp>/`; an update writes a new timestamped directory and swaps `..data`
    (the path's own symlink and its mtime never change)."""
    root.mkdir()
    (root / "..v1").mkdir()
    (root / "..v1" / "keys.toml").write_text(text)
    os.symlink("..v1", root / "..data")
    os.symlink("..data/keys.toml", root / "keys.toml")
    return root / "keys.toml"


def update_secret(root: Path, version: str, text: str) -> None:
    (root / version).mkdir()
    (root / version / "keys.toml").write_text(text)
    os.symlink(version, root / "..data_tmp")
    os.replace(root / "..data_tmp", root / "..data")  # atomic, as the kubelet does


def test_a_secret_symlink_swap_takes_effect_without_a_signal_or_a_worker_restart(
        tmp_path: Path) -> None:
    root = tmp_path / "secret"
    path = secret_volume(root, named("team-a", OLD_KEY))
    with Serve(front_args=("--api-key-file", str(path))) as serve:
        before = serve.health().json()
        assert serve.post(clef_body(), headers=bearer(OLD_KEY)).status == 200
        update_secret(root, "..v2", named("team-b", NEW_KEY))
        wait_until(lambda: serve.post(clef_body(), headers=bearer(NEW_KEY)).status == 200,
                   "the new key to be accepted")
        assert serve.post(clef_body(), headers=bearer(OLD_KEY)).status == 401
        serve.wait_for(r"API keys reloaded from .*keys.toml: 1 key\(s\) in force \(team-b\)")
        after = serve.health().json()
        assert after["worker"]["pid"] == before["worker"]["pid"] and after["restarts"] == 0
        assert "reload: rolling" not in serve.stderr  # no worker was touched

        update_secret(root, "..v3", 'keys = "not a table"\n')  # a botched rotation
        serve.wait_for(r"API keys not reloaded, 1 key\(s\) stay in force: .*holds no key")
        assert serve.post(clef_body(), headers=bearer(NEW_KEY)).status == 200
        assert OLD_KEY not in serve.stderr and NEW_KEY not in serve.stderr


def test_sighup_rolls_the_workers_and_leaves_the_keys_alone(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(OLD_KEY + "\n")
    with Serve(front_args=("--api-key-file", str(path))) as serve:
        pid = serve.health().json()["worker"]["pid"]
        serve.process.send_signal(signal.SIGHUP)
        serve.wait_for(r"reload finished: 1 of 1 worker\(s\) replaced")
        assert serve.health().json()["worker"]["pid"] != pid
        assert "API keys reloaded" not in serve.stderr
        assert serve.post(clef_body(), headers=bearer(OLD_KEY)).status == 200


def test_reload_if_changed_looks_at_identity_not_only_the_path(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(OLD_KEY + "\n")
    keys = ApiKeys(path)
    assert not keys.reload_if_changed()  # nothing changed
    replacement = tmp_path / "keys.new"
    replacement.write_text(NEW_KEY + "\n")
    os.replace(replacement, path)  # a new inode at the same path
    assert keys.reload_if_changed()
    assert keys.allows(f"Bearer {NEW_KEY}".encode()) and not keys.allows(
        f"Bearer {OLD_KEY}".encode())
    path.unlink()
    assert not keys.reload_if_changed()  # gone: the keys stay in force
    assert keys.allows(f"Bearer {NEW_KEY}".encode())
