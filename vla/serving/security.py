"""API keys for ``vla serve --api-key-file``: loading the key and checking ``Authorization: Api-Key <key>``.

The key is read once at start-up and never logged or echoed; the comparison is constant-time
(``hmac.compare_digest``) so response timing does not leak how much of a guessed key was right.
"""

from __future__ import annotations

import hmac
from pathlib import Path

SCHEME = "Api-Key"


def load_api_key(path: str | Path) -> str:
    """The key in ``path`` (its first line, surrounding whitespace stripped); errors name the file and the fix."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(
            f"--api-key-file {path}: cannot read it ({e.strerror}); pass a readable file"
        ) from None
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if len(key) < 16:
        raise ValueError(
            f"--api-key-file {path}: the key must be at least 16 characters on the first line, got "
            f"{len(key)}; generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}"
        )
    return key


def authorized(header: str | None, key: str | None) -> bool:
    """True when no key is configured, or ``header`` is ``Api-Key <key>``: the scheme in any case (HTTP auth schemes
    are case-insensitive, RFC 9110 §11.1), the key exact (constant-time comparison)."""
    if key is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    scheme_ok = scheme.lower() == SCHEME.lower()
    key_ok = hmac.compare_digest(given.encode("utf-8", "replace"), key.encode())
    return scheme_ok and key_ok
