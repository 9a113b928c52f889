"""Following one request's response records into one stream: attempts, migration, resume.

A request's records on its responses partition are token deltas and a final
response per *attempt*: when its worker is lost (error ``worker_lost`` or
``worker_stopped``) the client resubmits it with the output delivered so far
appended to its prompt (attempt + 1), and a worker thought lost may still
answer the earlier attempt. :class:`Follower` is the pure state machine
that turns those records, in partition order, into what the caller sees:
delta indices continuing across attempts, records of earlier attempts
dropped, and a final record with the whole output and usage.

The same records in the same order always give the same stream, so a stream
can be resumed by replaying the request's records from its first one and
skipping what was already delivered: a :class:`StreamCursor` says where.

No I/O here: :class:`~kvflow.streams.client.KvflowClient` reads the records
and acts on each :class:`Step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.schemas import FinalResponse, InferenceRequest, TokenDelta, deadline_exceeded

__all__ = ["MIGRATABLE", "StreamCursor", "Emit", "Resubmit", "Step", "Follower"]

MIGRATABLE = frozenset({"worker_lost", "worker_stopped"})
"""Error codes of a final record after which a request is resubmitted elsewhere."""


@dataclass(frozen=True)
class StreamCursor:
    """Where a reader of one request's stream stands.

    ``partition`` is the request's responses partition (its ``reply_to``),
    ``first_offset`` the offset there of the request's first response record
    (the replay starts at it), ``delivered`` the token deltas already
    delivered (the stream's delta indices 0 … delivered − 1).
    """

    request_id: str
    partition: int
    first_offset: int
    delivered: int = 0


@dataclass(frozen=True)
class Emit:
    """Pass ``event`` on to the reader (a final one ends the stream)."""

    event: TokenDelta | FinalResponse


@dataclass(frozen=True)
class Resubmit:
    """Send ``request`` (the next attempt) and keep reading."""

    request: InferenceRequest


Step = Emit | Resubmit | None
"""What to do after one record (None: nothing, the record is not part of the stream)."""


@dataclass
class Follower:
    """The stream of ``request`` built from its response records.

    ``max_migrations`` bounds the attempts after the first. With ``migrate``
    a migratable final is answered :class:`Resubmit`; without it (a replay
    of records another reader acted on) the final is *held*: records of the
    next attempt that follow it mean that reader resubmitted, and are
    followed; :meth:`release` gives the held final up as the stream's end.
    Migration needs ``request.token_ids``; without them a migratable final
    ends the stream.
    """

    request: InferenceRequest
    max_migrations: int
    migrate: bool = True
    attempt: int = field(init=False)
    held: FinalResponse | None = field(default=None, init=False)
    delivered_ids: list[int] = field(default_factory=list, init=False)
    delivered_text: list[str] = field(default_factory=list, init=False)
    prior: int = field(default=0, init=False)  # delivered ids produced before the current attempt
    index: int = field(default=0, init=False)  # index of the next delta passed on

    def __post_init__(self) -> None:
        self.attempt = self.request.attempt

    def feed(self, event: TokenDelta | FinalResponse) -> Step:
        """Account for one record of the request (in partition order)."""
        if self.held is not None:
            if event.attempt != self.attempt + 1:
                return None  # the held attempt ended: its worker, thought lost, still answering
            self._next_attempt()  # the reader that saw the held final resubmitted
        if event.attempt != self.attempt:
            return None  # an earlier attempt's worker still answering
        if isinstance(event, TokenDelta):
            self.delivered_ids.extend(event.token_ids)
            self.delivered_text.append(event.text)
            if event.index != self.index:
                event = event.model_copy(update={"index": self.index})
            self.index += 1
            return Emit(event)
        nxt = self._continuation(event)
        if nxt is not None:
            if not self.migrate:
                self.held = event
                return None
            self._next_attempt()
            return Resubmit(nxt)
        if self.attempt and event.error is None:
            event = self._merged_final(event)
        return Emit(event)

    def release(self) -> FinalResponse | None:
        """The held final, as the stream's end (None: none is held)."""
        held, self.held = self.held, None
        return held

    def deadline_final(self, message: str) -> FinalResponse:
        """The final record of a request that passed its deadline: error
        ``deadline_exceeded`` (504) with the output delivered so far."""
        usage = {"prompt_tokens": len(self.request.token_ids or ()), "completion_tokens": len(self.delivered_ids)}
        return FinalResponse(request_id=self.request.request_id, text="".join(self.delivered_text),
                             token_ids=list(self.delivered_ids), finish_reason="error", usage=usage,
                             error=deadline_exceeded(message), attempt=self.attempt)

    def _next_attempt(self) -> None:
        self.attempt += 1
        self.prior = len(self.delivered_ids)
        self.held = None

    def _continuation(self, final: FinalResponse) -> InferenceRequest | None:
        """The resubmission of the request after ``final`` (None: ``final`` ends the stream)."""
        original = self.request
        if (final.error is None or final.error.code not in MIGRATABLE or original.token_ids is None
                or self.attempt >= self.max_migrations):
            return None
        left = original.sampling.max_tokens - len(self.delivered_ids)
        if left <= 0:
            return None
        return original.model_copy(update={
            "token_ids": [*original.token_ids, *self.delivered_ids], "attempt": self.attempt + 1,
            "resumed_tokens": original.resumed_tokens + len(self.delivered_ids),
            "sampling": original.sampling.model_copy(update={"max_tokens": left}), "routing": None,
        })

    def _merged_final(self, final: FinalResponse) -> FinalResponse:
        """The final record of a migrated request as one uninterrupted request's:
        the earlier attempts' output then the final's ids, the whole text,
        the original prompt length."""
        prior_ids = self.delivered_ids[:self.prior]
        usage = final.usage.model_copy(update={
            "prompt_tokens": len(self.request.token_ids or ()),
            "completion_tokens": len(prior_ids) + final.usage.completion_tokens})
        return final.model_copy(update={"token_ids": [*prior_ids, *final.token_ids],
                                        "text": "".join(self.delivered_text), "usage": usage})
