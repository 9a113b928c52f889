"""Ids of the bridge's SSE events, and reading them back from ``Last-Event-ID``.

Every event of a streamed answer (but the closing ``[DONE]``) carries

    id: <request_id>:<seq>:<partition>:<first_offset>:<created_ms>

``seq`` numbers the stream's events from 0 (the role chunk of a chat
stream, the echo or first text chunk of a completion); ``partition`` and
``first_offset`` locate the request's first record on the responses topic;
``created_ms`` is when the bridge received the request (its deadline and
the chunks' ``created`` derive from it).

Why a sequence number and a Kafka position rather than a token index or
the offset of the last record: the events of a stream are a pure function
of the request's records (:mod:`kvflow.streams.follow`), so replaying the
records from the first one rebuilds the same events, and skipping the
first ``seq + 1`` of them resumes exactly, including events that carry no
token (role, finish, usage) and records whose text is empty; the first
offset lets any bridge replica read the records (no index, no lookup by
time, which the embedded broker does not answer). The id names the request
too, so ``Last-Event-ID`` alone is enough to resume.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EventId"]


@dataclass(frozen=True)
class EventId:
    """One SSE event's place in its stream (see the module doc)."""

    request_id: str
    seq: int
    partition: int
    first_offset: int
    created_ms: int

    def __str__(self) -> str:
        return f"{self.request_id}:{self.seq}:{self.partition}:{self.first_offset}:{self.created_ms}"

    def at(self, seq: int) -> "EventId":
        """The id of event ``seq`` of the same stream."""
        return EventId(self.request_id, seq, self.partition, self.first_offset, self.created_ms)

    @classmethod
    def parse(cls, text: str) -> "EventId":
        """Read an id written by :meth:`__str__`.

        Raises:
            ValueError: ``text`` is not such an id (five ``:``-separated
                fields, the last four non-negative integers, a non-empty
                request id of at most 256 characters).
        """
        parts = text.strip().rsplit(":", 4)
        if len(parts) != 5 or not parts[0] or len(parts[0]) > 256:
            raise ValueError(f"not a kvflow event id: {text!r}")
        try:
            seq, partition, first_offset, created_ms = (int(p) for p in parts[1:])
        except ValueError:
            raise ValueError(f"not a kvflow event id: {text!r}") from None
        if min(seq, partition, first_offset, created_ms) < 0:
            raise ValueError(f"not a kvflow event id: {text!r}")
        return cls(parts[0], seq, partition, first_offset, created_ms)
