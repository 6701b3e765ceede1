"""Bearer API keys: where they come from, who a request's key belongs to, how they rotate.

Keys come from `--api-key-file` and from the `CLEF_API_KEY` environment variable, never from
the command line, where any user of the host could read them in the process list. With neither,
authentication is off and any `Authorization` header is ignored, as before keys existed.

Two file formats. A plain file holds one key a line (blank lines and `#` comments skipped); each
key's name is `sha256:` and the first 8 hex digits of its SHA-256 (stable across rotations of
the other keys, and no secret). A file ending in `.toml` holds named keys, each with its own
quota and default priority class:

    [keys.rag-ingest]
    key = "sk-..."          # or key_sha256 = "<64 hex>", so the file holds no secret
    rate = 20               # requests per second, sustained (absent: unlimited)
    burst = 40              # bucket size (default: rate, at least 1)
    priority = "bulk"       # this key's default class (default: interactive)

The environment's key is named `env`. Names (never keys) go to the access log and the `key`
label of the request counter; the file bounds how many there are.

Rotation: `watch()` polls the file (its device, inode, size and modification time, following
symlinks: a Kubernetes Secret update swaps a symlink and leaves the path's own mtime alone) and
re-reads it when any of them changes, with no signal needed. A reload that fails (unreadable, no
key, a malformed entry) keeps the keys in force and says why in the log: a typo during a
rotation must not lock every client out, nor open the server to everyone.

A presented key is compared with every configured key in constant time (`hmac.compare_digest`
over SHA-256 digests, all keys compared every time), so response timing says nothing about how
much of a key was right or which key it matched. No key, presented or configured, is ever
written to a log line.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_api import responses
from clef_api.credentials import ENV_VAR
from clef_api.responses import Reply
from clef_frontend.priority import INTERACTIVE, check_class

log = logging.getLogger("clef_frontend.auth")

__all__ = ["ENV_VAR", "NO_KEY", "ApiKeys"]

ENV_KEY_NAME = "env"
NO_KEY = "-"  # the key name of a request that presented no key in force (auth off, or refused)
UNAUTHORIZED_DETAIL = "missing or invalid API key"
# How often the key file is looked at for a change: a rotated key works within this long.
KEY_POLL_SECONDS = 1.0
_SCHEME = b"bearer"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_ENTRY_FIELDS = {"key", "key_sha256", "rate", "burst", "priority"}


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, never a key."""


@dataclass(frozen=True)
class NamedKey:
    """One key in force: its name, the SHA-256 of the key, its quota and default class."""

    name: str
    digest: bytes
    rate: float | None = None  # requests per second, sustained; None: unlimited
    burst: float = 1.0  # the bucket's size (requests at once after a quiet spell)
    priority: str = INTERACTIVE


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def plain_key(key: str, name: str | None = None) -> NamedKey:
    """A key of the plain format (or the environment's): no quota, interactive."""
    digest = _digest(key.encode("utf-8"))
    return NamedKey(name or f"sha256:{digest.hex()[:8]}", digest)


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys of a plain file, in order; KeyFileError if unreadable or without a key."""
    keys = tuple(
        line.strip() for line in _read(path).splitlines()
        if line.strip() and not line.strip().startswith("#")
    )
    if not keys:
        raise KeyFileError(f"--api-key-file {path}: holds no key (one key per line)")
    return keys


def load_key_file(path: Path) -> tuple[NamedKey, ...]:
    """The keys in force from `path` (plain or `.toml`); KeyFileError says what is wrong."""
    if path.suffix == ".toml":
        return _read_toml(path)
    return tuple(plain_key(key) for key in read_key_file(path))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise KeyFileError(f"--api-key-file {path}: cannot read it: {reason}") from None


def _read_toml(path: Path) -> tuple[NamedKey, ...]:
    try:
        document = tomllib.loads(_read(path))
    except tomllib.TOMLDecodeError as exc:
        # The parser's message names a line and column, never the text found there.
        raise KeyFileError(f"--api-key-file {path}: not valid TOML: {exc}") from None
    table = document.get("keys")
    if not isinstance(table, dict) or not table:
        raise KeyFileError(f"--api-key-file {path}: holds no key (expected [keys.NAME] tables)")
    extra = sorted(set(document) - {"keys"})
    if extra:
        raise KeyFileError(f"--api-key-file {path}: unknown top-level entries {extra}")
    entries = tuple(_entry(path, name, fields) for name, fields in table.items())
    seen: dict[bytes, str] = {}
    for entry in entries:
        if entry.digest in seen:
            raise KeyFileError(f"--api-key-file {path}: keys.{entry.name} has the same key as "
                               f"keys.{seen[entry.digest]}")
        seen[entry.digest] = entry.name
    return entries


def _entry(path: Path, name: str, fields: Any) -> NamedKey:
    where = f"--api-key-file {path}: keys.{name}"
    if not _NAME.fullmatch(name):
        raise KeyFileError(f"--api-key-file {path}: key name {name[:70]!r} must be 1-64 "
                           f"letters, digits, '.', '_' or '-'")
    if not isinstance(fields, dict):
        raise KeyFileError(f"{where}: expected a table")
    unknown = sorted(set(fields) - _ENTRY_FIELDS)
    if unknown:
        raise KeyFileError(f"{where}: unknown fields {unknown}")
    key, hashed = fields.get("key"), fields.get("key_sha256")
    if (key is None) == (hashed is None):
        raise KeyFileError(f"{where}: give exactly one of key and key_sha256")
    if key is not None:
        if not isinstance(key, str) or not key.strip():
            raise KeyFileError(f"{where}: key must be a non-empty string")
        digest = _digest(key.strip().encode("utf-8"))
    else:
        if not isinstance(hashed, str) or not _HEX_DIGEST.fullmatch(hashed):
            raise KeyFileError(f"{where}: key_sha256 must be 64 hex digits")
        digest = bytes.fromhex(hashed)
    rate = _positive(where, "rate", fields.get("rate"))
    burst = _positive(where, "burst", fields.get("burst"))
    if burst is not None and rate is None:
        raise KeyFileError(f"{where}: burst without rate")
    priority = fields.get("priority", INTERACTIVE)
    try:
        priority = check_class(str(priority), where)
    except ValueError as exc:
        raise KeyFileError(str(exc)) from None
    return NamedKey(name, digest, rate, max(burst or rate or 1.0, 1.0), priority)


def _positive(where: str, field: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        raise KeyFileError(f"{where}: {field} must be a positive number, got {value!r}")
    return float(value)


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a rewritten or swapped key file apart: stat through symlinks."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ApiKeys:
    """The keys in force; `identify` says whose key a request carries, `check` answers 401."""

    def __init__(self, key_file: Path | None = None, env_key: str | None = None) -> None:
        """Load the keys now; KeyFileError if `key_file` is given but unusable."""
        self._file = key_file
        env = (env_key or "").strip()
        self._env_key = plain_key(env, ENV_KEY_NAME) if env else None
        self._file_keys: tuple[NamedKey, ...] = ()
        self._keys: tuple[NamedKey, ...] = ()
        self._signature = _signature(key_file) if key_file is not None else None
        if key_file is not None:
            self._file_keys = load_key_file(key_file)
        self._rebuild()

    @property
    def enabled(self) -> bool:
        """Whether requests must present a key."""
        return bool(self._keys)

    @property
    def count(self) -> int:
        return len(self._keys)

    def reload(self) -> bool:
        """Re-read the key file; on failure keep the keys in force and log why. True if the
        keys were replaced."""
        if self._file is None:
            return False
        try:
            self._file_keys = load_key_file(self._file)
        except KeyFileError as exc:
            log.error("API keys not reloaded, %d key(s) stay in force: %s", self.count, exc)
            return False
        self._rebuild()
        log.info("API keys reloaded from %s: %d key(s) in force (%s)", self._file, self.count,
                 ", ".join(key.name for key in self._keys))
        return True

    def reload_if_changed(self) -> bool:
        """Reload when the file's identity or contents changed since the last look."""
        if self._file is None:
            return False
        signature = _signature(self._file)
        if signature == self._signature:
            return False
        self._signature = signature
        if signature is None:
            log.error("API key file %s is gone, %d key(s) stay in force", self._file, self.count)
            return False
        return self.reload()

    async def watch(self, interval: float = KEY_POLL_SECONDS) -> None:
        """Poll the key file until cancelled; a change takes effect within `interval`."""
        if self._file is None:
            return
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()

    def _rebuild(self) -> None:
        self._keys = (*self._file_keys, *([self._env_key] if self._env_key else []))

    def identify(self, authorization: bytes | None) -> NamedKey | None:
        """The key in force that the `Authorization` header carries, or None."""
        presented = _bearer_token(authorization)
        if presented is None or not self._keys:
            return None
        candidate = _digest(presented)
        found = None
        for key in self._keys:  # every key, every time: no early exit to time
            if hmac.compare_digest(candidate, key.digest):
                found = key
        return found

    def allows(self, authorization: bytes | None) -> bool:
        """Whether the `Authorization` header value carries a key in force."""
        return not self._keys or self.identify(authorization) is not None

    def check(self, authorization: bytes | None) -> Reply | None:
        """None to let the request through, else its 401 (before the body is read)."""
        if self.allows(authorization):
            return None
        return unauthorized()


def unauthorized() -> Reply:
    """401 with the challenge RFC 6750 asks for."""
    return responses.error(401, UNAUTHORIZED_DETAIL,
                           extra_headers=(("WWW-Authenticate", "Bearer"),))


def _bearer_token(authorization: bytes | None) -> bytes | None:
    """`Bearer <token>` (scheme in any case) -> token; anything else -> None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != _SCHEME or not token:
        return None
    return token
