"""Records on the dead-letter topic: inputs no consumer could process."""

from __future__ import annotations

from kvflow.schemas.base import Record

__all__ = ["DeadLetter"]


class DeadLetter(Record):
    """A record that failed to decode or process, kept verbatim for inspection.

    ``value`` is the original bytes decoded as UTF-8 with replacement
    characters (JSON records survive intact); ``error`` says why it failed.
    """

    source_topic: str
    partition: int
    offset: int
    key: str | None = None
    value: str
    error: str
    consumer: str
    ts_ms: int
