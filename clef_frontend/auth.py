"""Bearer API keys: where they come from, how a request's key is checked, how they rotate.

Keys come from `--api-key-file` (one key per line; blank lines and `#` comments are skipped)
and from the `CLEF_API_KEY` environment variable, never from the command line, where any user
of the host could read them in the process list. With neither, authentication is off and any
`Authorization` header is ignored, as before keys existed.

The file is read again on SIGHUP, so keys rotate without a restart. A reload that fails (the
file is unreadable or now holds no key) keeps the keys in force and says so in the log: a typo
during a rotation must not lock every client out, nor open the server to everyone.

A presented key is compared with every configured key in constant time (`hmac.compare_digest`
over SHA-256 digests, all keys compared every time), so response timing says nothing about how
much of a key was right. No key, presented or configured, is ever written to a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from clef_frontend import responses
from clef_frontend.responses import Reply

log = logging.getLogger("clef_frontend.auth")

ENV_VAR = "CLEF_API_KEY"
UNAUTHORIZED_DETAIL = "missing or invalid API key"
_SCHEME = b"bearer"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, never a key."""


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys in `path`, in order; KeyFileError if unreadable or without a key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise KeyFileError(f"--api-key-file {path}: cannot read it: {reason}") from None
    keys = tuple(
        line.strip() for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    )
    if not keys:
        raise KeyFileError(f"--api-key-file {path}: holds no key (one key per line)")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The keys in force; `check` answers 401 or lets a request through."""

    def __init__(self, key_file: Path | None = None, env_key: str | None = None) -> None:
        """Load the keys now; KeyFileError if `key_file` is given but unusable."""
        self._file = key_file
        self._env_key = (env_key or "").strip() or None
        self._digests: tuple[bytes, ...] = ()
        self._file_keys: tuple[str, ...] = ()
        if key_file is not None:
            self._file_keys = read_key_file(key_file)
        self._rebuild()

    @property
    def enabled(self) -> bool:
        """Whether requests must present a key."""
        return bool(self._digests)

    @property
    def count(self) -> int:
        return len(self._digests)

    def reload(self) -> None:
        """Re-read the key file (SIGHUP); on failure keep the keys in force and log why."""
        if self._file is None:
            log.info("SIGHUP: no --api-key-file to reload (%d key(s) in force)", self.count)
            return
        try:
            self._file_keys = read_key_file(self._file)
        except KeyFileError as exc:
            log.error("SIGHUP: API keys not reloaded, %d key(s) stay in force: %s",
                      self.count, exc)
            return
        self._rebuild()
        log.info("SIGHUP: API keys reloaded from %s: %d key(s) in force", self._file, self.count)

    def _rebuild(self) -> None:
        keys = [*self._file_keys, *([self._env_key] if self._env_key else [])]
        self._digests = tuple(_digest(key.encode("utf-8")) for key in keys)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether the `Authorization` header value carries a key in force."""
        if not self._digests:
            return True
        presented = _bearer_token(authorization)
        if presented is None:
            return False
        candidate = _digest(presented)
        matched = False
        for digest in self._digests:  # every key, every time: no early exit to time
            matched |= hmac.compare_digest(candidate, digest)
        return matched

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
