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
        # utf-8-sig: a byte-order mark (Windows editors, PowerShell's Out-File) is not part of the key
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(
            f"--api-key-file {path}: cannot read it ({e.strerror}); pass a readable file"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--api-key-file {path}: not UTF-8 text ({e.reason} at byte {e.start}); write the key as plain text"
        ) from None
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    bad = sorted({c for c in key if not "!" <= c <= "~"})
    # an HTTP header carries the key: printable ASCII only (a client would send other bytes differently)
    if bad:
        raise ValueError(
            f"--api-key-file {path}: the key holds {len(bad)} character(s) an HTTP header cannot carry as is "
            f"(e.g. {bad[0]!r}); use printable ASCII without spaces, e.g. python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))' > {path}"
        )
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
    scheme, _, given = (header or "").strip().partition(" ")
    given = given.lstrip(" ")  # RFC 9110: one or more spaces after the scheme
    scheme_ok = scheme.lower() == SCHEME.lower()
    key_ok = hmac.compare_digest(given.encode("utf-8", "replace"), key.encode())
    return scheme_ok and key_ok
