"""Requests whose worker died: answer them instead of leaving them to time out.

A worker that crashes (no ``stopped`` heartbeat; its heartbeats stop and the
router expires it after its TTL) takes the requests it held with it: their
clients would otherwise wait for a final record until the bridge's request
timeout (minutes). The router replica that routed a request remembers where
it sent it and its ``reply_to`` until the serving worker's finish record
(``inflight`` topic) arrives; when a worker expires, every remembered
request that still depends on it is answered with a retryable error (HTTP
503, ``worker_lost``): its decode/aggregated worker until the end; its
remote prefill worker until that worker's finish record of the prefill; the
encode worker that turns its media into embeddings until a worker that
serves it admits it (the encode worker sent it on).

Only the replica that routed a request answers it (replicas split the
request stream), so each lost request gets one answer. A request whose
final record reached its client just before the crash, but whose finish
record did not, gets a second, error, final; clients stop reading a request
at its first final record, so it is ignored.

Pure state, no I/O: the router app feeds it decisions, finish records and
expired worker ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from kvflow.schemas import ReplyTo

__all__ = ["Routed", "Orphans", "MAX_REMEMBERED"]

MAX_REMEMBERED = 100_000
"""Routed requests one replica remembers (oldest forgotten first): far above
the requests a deployment holds at once (~200 bytes each)."""


@dataclass(frozen=True)
class Routed:
    """Where one request went: its serving worker, its remote prefill worker
    (None when prefilled locally, or once that prefill finished), the encode
    worker of its media (None without one, or once it sent the request on)
    and where its answer goes."""

    request_id: str
    worker_id: str
    prefill_worker_id: str | None
    reply_to: ReplyTo
    attempt: int = 0
    encode_worker_id: str | None = None

    def depends_on(self, gone: set[str]) -> bool:
        """Whether a worker of ``gone`` still holds a part of this request."""
        return self.worker_id in gone or self.prefill_worker_id in gone or self.encode_worker_id in gone


@dataclass
class Orphans:
    """Requests this replica routed and whose serving worker has not yet
    reported them finished."""

    limit: int = MAX_REMEMBERED
    _routed: OrderedDict[str, Routed] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._routed)

    def note(self, routed: Routed) -> None:
        """Remember a routing decision (the newest wins for a reused id)."""
        self._routed[routed.request_id] = routed
        self._routed.move_to_end(routed.request_id)
        while len(self._routed) > self.limit:
            self._routed.popitem(last=False)

    def finished(self, request_id: str, worker_id: str) -> None:
        """Forget ``request_id`` once its serving worker ended it; a prefill
        worker's finish record of a remote prefill only ends the request's
        dependence on that worker."""
        routed = self._routed.get(request_id)
        if routed is None:
            return
        if routed.worker_id == worker_id:
            del self._routed[request_id]
        elif routed.prefill_worker_id == worker_id:
            self._routed[request_id] = replace(routed, prefill_worker_id=None)

    def admitted(self, request_id: str, worker_id: str) -> None:
        """A worker took ``request_id`` from its queue: if it serves or
        prefills it, the encode worker (if any) has sent it on."""
        routed = self._routed.get(request_id)
        if routed is not None and routed.encode_worker_id is not None \
                and worker_id in (routed.worker_id, routed.prefill_worker_id):
            self._routed[request_id] = replace(routed, encode_worker_id=None)

    def take_lost(self, gone: list[str] | set[str]) -> list[Routed]:
        """Remove and return the requests that still depend on a worker in
        ``gone`` (:meth:`Routed.depends_on`), oldest first."""
        if not gone:
            return []
        gone = set(gone)
        lost = [r for r in self._routed.values() if r.depends_on(gone)]
        for r in lost:
            del self._routed[r.request_id]
        return lost
