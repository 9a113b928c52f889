"""The bridge's API keys: where they come from and how a presented key is checked.

Keys come from ``Settings.api_keys`` (``KVFLOW_API_KEYS``, comma-separated)
and ``Settings.api_keys_file`` (one key per line). No keys at all means the
bridge is open. A presented key is compared with every configured key in
constant time (:func:`hmac.compare_digest`), so response timing tells an
attacker nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from pathlib import Path

from kvflow.settings import Settings

__all__ = ["read_api_keys_file", "configured_api_keys", "key_matches", "log_auth_mode"]

log = logging.getLogger(__name__)


def read_api_keys_file(path: str | Path) -> list[str]:
    """The keys in ``path``: one per line, surrounding whitespace stripped,
    blank lines and lines starting with ``#`` skipped.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file holds no key (a file given for keys that has
            none would silently leave the bridge open).
    """
    keys = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"API keys file {path} holds no key")
    return keys


def configured_api_keys(settings: Settings) -> frozenset[str]:
    """Every key the bridge accepts (empty: the bridge is open).

    Raises:
        OSError, ValueError: see :func:`read_api_keys_file`.
    """
    keys = set(settings.api_keys)
    if settings.api_keys_file:
        keys.update(read_api_keys_file(settings.api_keys_file))
    return frozenset(keys)


def key_matches(presented: str, keys: Iterable[str]) -> bool:
    """Whether ``presented`` is one of ``keys``.

    Every key is compared, each in constant time, so neither the position of
    a match nor the length of a common prefix shows in the timing.
    """
    given = presented.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    return matched


def log_auth_mode(keys: frozenset[str]) -> None:
    """Log, once at start, whether the bridge requires a key (warning when open)."""
    if keys:
        log.info("bridge requires an API key (%d configured)", len(keys))
    else:
        log.warning("no API keys configured: the bridge serves anyone who can reach it "
                    "(set KVFLOW_API_KEYS or pass `kvflow up --api-keys-file`)")
