"""Which encode worker turns a routed request's media into embeddings.

A request whose media still carry bytes (:attr:`~kvflow.schemas.InferenceRequest.needs_encoding`)
goes from the router to an encode worker of its model, which sends it on to
the worker the routing policy chose (:mod:`kvflow.workers.encode_worker`).
Each encode worker keeps an embedding cache keyed by content hash, so the
same media should reach the same encode worker: :func:`pick_encode_worker`
uses rendezvous (highest random weight) hashing on the media's content hash
(Thaler and Ravishankar, "Using name-based mappings to increase hit rates",
IEEE/ACM ToN 1998): each serving encode worker scores
``xxh3_64(worker_id, seed=content_hash)`` and the highest wins, so a worker
joining or leaving moves only the media it wins or held. Pure: every router
replica picks the same worker from the same table.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from kvflow.schemas import InferenceRequest, WorkerRole, WorkerStatus
from kvflow.streams.workers import WorkerView

__all__ = ["encode_key", "pick_encode_worker"]


def encode_key(request: InferenceRequest) -> int:
    """The content hash that places ``request`` on an encode worker: its first
    media item still carrying bytes (0 when none does)."""
    return next((item.content_hash for item in request.media or () if item.embeds is None), 0)


def pick_encode_worker(workers: Iterable[WorkerView], model: str, key: int) -> WorkerView | None:
    """The serving encode worker of ``model`` with the highest rendezvous score
    for ``key`` (module doc); None when none serves it."""
    best, best_score = None, -1
    for w in workers:
        if w.role is not WorkerRole.encode or w.model != model or w.status is not WorkerStatus.serving:
            continue
        score = xxhash.xxh3_64_intdigest(w.worker_id.encode(), key & ((1 << 64) - 1))
        if score > best_score or (score == best_score and best is not None and w.worker_id < best.worker_id):
            best, best_score = w, score
    return best
