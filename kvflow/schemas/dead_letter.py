"""Records on the dead-letter topic: inputs no consumer could process."""

from __future__ import annotations

import base64

from kvflow.schemas.base import Record, now_ms

__all__ = ["DeadLetter"]


def _text_and_b64(raw: bytes | None) -> tuple[str | None, str | None]:
    """``raw`` as text, plus its base64 when the text does not hold it exactly."""
    if raw is None:
        return None, None
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace"), base64.b64encode(raw).decode("ascii")


class DeadLetter(Record):
    """A record that failed to decode or process, kept verbatim for inspection.

    ``value`` is the original value decoded as UTF-8 (JSON records survive
    intact; ``""`` for a null value). When the original bytes are not valid
    UTF-8, ``value`` holds them with replacement characters, for reading, and
    ``value_b64`` holds them exactly (standard base64); likewise ``key`` and
    ``key_b64``. :meth:`original_value` and :meth:`original_key` give the
    bytes back either way. ``error`` says why the record failed and
    ``consumer`` who gave up on it; ``source_topic``, ``partition`` and
    ``offset`` locate it.

    ``value_b64`` and ``key_b64`` were added after version 1 first shipped;
    older readers ignore them and older letters lack them (their ``value``
    is all there is).
    """

    source_topic: str
    partition: int
    offset: int
    key: str | None = None
    key_b64: str | None = None
    value: str
    value_b64: str | None = None
    error: str
    consumer: str
    ts_ms: int

    @classmethod
    def of(cls, *, source_topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
           error: str | BaseException, consumer: str, ts_ms: int | None = None) -> "DeadLetter":
        """The dead letter of one consumed record, from its raw key and value bytes.

        ``error`` is truncated to 4000 characters; ``ts_ms`` defaults to now.
        Non-bytes keys or values (a deserializer already ran) are kept as
        their ``str``.
        """
        if key is not None and not isinstance(key, bytes):
            key = str(key).encode()
        if value is not None and not isinstance(value, bytes):
            value = str(value).encode()
        key_text, key_b64 = _text_and_b64(key)
        value_text, value_b64 = _text_and_b64(value)
        return cls(source_topic=source_topic, partition=partition, offset=offset, key=key_text, key_b64=key_b64,
                   value=value_text or "", value_b64=value_b64, error=str(error)[:4000], consumer=consumer,
                   ts_ms=now_ms() if ts_ms is None else ts_ms)

    def original_value(self) -> bytes:
        """The dead record's value bytes exactly (a null value gives ``b""``).

        Raises:
            binascii.Error: ``value_b64`` is not valid base64 (a forged letter).
        """
        if self.value_b64 is not None:
            return base64.b64decode(self.value_b64, validate=True)
        return self.value.encode("utf-8")

    def original_key(self) -> bytes | None:
        """The dead record's key bytes exactly, or None if it had no key.

        Raises:
            binascii.Error: ``key_b64`` is not valid base64 (a forged letter).
        """
        if self.key_b64 is not None:
            return base64.b64decode(self.key_b64, validate=True)
        return None if self.key is None else self.key.encode("utf-8")

