"""Load shedding: what the router does when every worker is busy.

A worker is *busy* when its KV cache is nearly full (``kv_used_blocks /
kv_total_blocks > kv_threshold``) or its queued prompt work is too large
(``active_prefill_tokens > prefill_token_threshold``), judged from its last
heartbeat (:class:`~kvflow.router.table.WorkerView`). The checks are ORed,
as in Dynamo's request rejection (``--active-decode-blocks-threshold``,
``--active-prefill-tokens-threshold``; its docs' examples use 0.85 and
10,000 and leave both off by default).

:func:`shed` decides per request:

* some candidate is not busy → ``route`` among those only (the routing
  policy never sees a busy worker);
* every candidate is busy and the mode is ``reject`` → ``reject``: the
  router answers HTTP 503 with a ``Retry-After`` of :func:`retry_after_s`
  seconds;
* every candidate is busy and the mode is ``queue`` → ``queue`` in a
  :class:`BoundedRequestQueue` (``fcfs`` or ``sjf`` = shortest ISL first)
  or, in ``priority`` order, a :class:`~kvflow.router.fair_queue.FairRequestQueue`
  (priority class, then per-tenant fair share, then earliest deadline),
  released one at a time while some worker is not busy; a full queue rejects
  (``priority``: it sheds the lowest class first).

Pure data structures and functions: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Generic, TypeVar

from kvflow.router.table import WorkerView

__all__ = [
    "BoundedRequestQueue",
    "QueueFull",
    "QueueOrder",
    "ShedAction",
    "ShedConfig",
    "ShedDecision",
    "ShedMode",
    "busy_reason",
    "has_free_worker",
    "is_busy",
    "retry_after_s",
    "shed",
]

T = TypeVar("T")


class ShedMode(str, Enum):
    """What to do when every candidate is busy."""

    reject = "reject"
    queue = "queue"


class QueueOrder(str, Enum):
    """Release order of queued requests: arrival order, shortest ISL first, or
    priority class → tenant fair share → earliest deadline
    (:mod:`kvflow.router.fair_queue`)."""

    fcfs = "fcfs"
    sjf = "sjf"
    priority = "priority"


@dataclass(frozen=True)
class ShedConfig:
    """Load-shedding settings.

    Attributes:
        kv_threshold: busy when used / total KV blocks exceeds this fraction
            (0..1]. Defaults to ``0.95`` (kvflow's choice: room for the
            running requests' next blocks; 1.0 disables the check).
        prefill_token_threshold: busy when queued prompt tokens exceed this;
            None disables the check. Defaults to ``None`` (as Dynamo's
            threshold is off by default).
        mode: ``reject`` or ``queue``. Defaults to ``reject``.
        queue_capacity: most requests held in ``queue`` mode (>= 1).
            Defaults to ``256``.
        queue_order: ``fcfs``, ``sjf`` or ``priority``. Defaults to ``fcfs``.
        prefill_tokens_per_s: assumed prompt throughput of one worker, used
            only to estimate ``Retry-After``. Defaults to ``10_000`` (kvflow's
            choice, a conservative single-GPU figure; the mocker's default
            perf model prefills ~45k tokens/s).
        kv_drain_s: assumed time for a KV-busy worker to free blocks
            (running requests finish), for ``Retry-After``. Defaults to ``2.0``.
        retry_after_min_s: lower bound of ``Retry-After``. Defaults to ``1``.
        retry_after_max_s: upper bound of ``Retry-After``. Defaults to ``60``.
        reserve_fraction: share of each busy threshold held back for the
            top classes: a request of priority below ``reserve_priority``
            finds a worker busy at ``kv_threshold × (1 − reserve_fraction)``
            KV use and ``prefill_token_threshold × (1 − reserve_fraction)``
            queued prompt tokens, so a higher-class arrival finds room a
            request already running cannot give back (engines do not
            preempt by class). Defaults to ``0.0`` (no reserve).
        reserve_priority: the lowest class the reserve is kept for.
            Defaults to ``1`` (above the default class 0).
        cold_start_hold_ms: ``queue`` mode only: a request for a model that
            no worker serves is held in the queue for up to this many ms
            instead of being answered 503 ``no_workers`` at once, so a pool
            scaled to zero serves it once the worker the planner starts
            registers. Held longer, it is answered 503 ``no_workers``.
            None: no hold (503 at once). Defaults to ``None``.

    Raises:
        ValueError: a threshold or bound out of range.
    """

    kv_threshold: float = 0.95
    prefill_token_threshold: int | None = None
    mode: ShedMode = ShedMode.reject
    queue_capacity: int = 256
    queue_order: QueueOrder = QueueOrder.fcfs
    prefill_tokens_per_s: float = 10_000.0
    kv_drain_s: float = 2.0
    retry_after_min_s: int = 1
    retry_after_max_s: int = 60
    reserve_fraction: float = 0.0
    reserve_priority: int = 1
    cold_start_hold_ms: int | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> "ShedConfig":
        """The shedding settings of :class:`kvflow.settings.Settings` (``shed_kv_threshold``,
        ``shed_prefill_token_threshold``, ``shed_mode``, ``shed_queue_capacity``,
        ``shed_queue_order``, ``shed_reserve_fraction``, ``shed_reserve_priority``,
        ``shed_cold_start_hold_s``); the other fields keep their defaults.

        Raises:
            ValueError: a value out of range.
        """
        return cls(kv_threshold=settings.shed_kv_threshold,
                   prefill_token_threshold=settings.shed_prefill_token_threshold, mode=settings.shed_mode,
                   queue_capacity=settings.shed_queue_capacity, queue_order=settings.shed_queue_order,
                   reserve_fraction=settings.shed_reserve_fraction,
                   reserve_priority=settings.shed_reserve_priority,
                   cold_start_hold_ms=(None if settings.shed_cold_start_hold_s is None
                                       else int(settings.shed_cold_start_hold_s * 1000)))

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ValueError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if self.prefill_token_threshold is not None and self.prefill_token_threshold < 0:
            raise ValueError(f"prefill_token_threshold must be >= 0, got {self.prefill_token_threshold}")
        if self.queue_capacity < 1:
            raise ValueError(f"queue_capacity must be >= 1, got {self.queue_capacity}")
        if self.prefill_tokens_per_s <= 0 or self.kv_drain_s < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and kv_drain_s >= 0")
        if not 0 <= self.retry_after_min_s <= self.retry_after_max_s:
            raise ValueError("need 0 <= retry_after_min_s <= retry_after_max_s")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        object.__setattr__(self, "mode", ShedMode(self.mode))
        if self.cold_start_hold_ms is not None and (self.cold_start_hold_ms < 0 or self.mode is not ShedMode.queue):
            raise ValueError("cold_start_hold_ms must be >= 0 and needs mode='queue' (held requests wait in the queue)")
        object.__setattr__(self, "queue_order", QueueOrder(self.queue_order))
        below = self
        if self.reserve_fraction > 0:
            keep = 1.0 - self.reserve_fraction
            limit = self.prefill_token_threshold
            below = replace(self, kv_threshold=self.kv_threshold * keep, reserve_fraction=0.0,
                            prefill_token_threshold=None if limit is None else int(limit * keep))
        object.__setattr__(self, "_below_reserve", below)

    def for_priority(self, priority: int) -> "ShedConfig":
        """The settings a request of class ``priority`` is shed by: these, or
        below ``reserve_priority`` the thresholds less the reserve."""
        return self if priority >= self.reserve_priority else self._below_reserve  # type: ignore[attr-defined]


def busy_reason(worker: WorkerView, cfg: ShedConfig) -> str | None:
    """Why ``worker`` is busy (``"kv"`` or ``"prefill"``), or None if it is not.

    A worker reporting no KV blocks (``kv_total_blocks == 0``) is never
    KV-busy.
    """
    total = worker.kv_total_blocks
    if total > 0 and worker.kv_used_blocks > cfg.kv_threshold * total:
        return "kv"
    limit = cfg.prefill_token_threshold
    if limit is not None and worker.active_prefill_tokens > limit:
        return "prefill"
    return None


def is_busy(worker: WorkerView, cfg: ShedConfig) -> bool:
    """Whether ``worker`` should get no new request (see :func:`busy_reason`)."""
    return busy_reason(worker, cfg) is not None


def retry_after_s(busy: Sequence[WorkerView], cfg: ShedConfig, queued: int = 0) -> int:
    """Seconds a rejected client should wait before retrying (HTTP ``Retry-After``).

    Estimate of when the first worker stops being busy: for a prefill-busy
    worker, its prompt tokens above the threshold at ``prefill_tokens_per_s``;
    for a KV-busy one, ``kv_drain_s``. The soonest worker counts, plus
    ``queued`` requests already waiting (each assumed to take that long
    again, spread over all ``busy`` workers). Rounded up and clamped to
    ``[retry_after_min_s, retry_after_max_s]``.
    """
    waits = []
    for w in busy:
        reason = busy_reason(w, cfg)
        if reason == "kv":
            waits.append(cfg.kv_drain_s)
        elif reason == "prefill":
            excess = w.active_prefill_tokens - (cfg.prefill_token_threshold or 0)
            waits.append(excess / cfg.prefill_tokens_per_s)
    first = min(waits) if waits else float(cfg.retry_after_min_s)
    est = first * (1 + queued / max(len(busy), 1))
    return int(min(max(math.ceil(est), cfg.retry_after_min_s), cfg.retry_after_max_s))


class ShedAction(str, Enum):
    """Outcome of :func:`shed`."""

    route = "route"
    reject = "reject"
    queue = "queue"


@dataclass(frozen=True)
class ShedDecision:
    """What to do with one request.

    Attributes:
        action: ``route`` (to one of ``candidates``), ``reject`` or ``queue``.
        candidates: the non-busy workers (empty unless ``route``).
        retry_after_s: ``Retry-After`` seconds for ``reject``, else None.
        reason: short text for logs and the error body.
    """

    action: ShedAction
    candidates: tuple[WorkerView, ...] = ()
    retry_after_s: int | None = None
    reason: str = ""


def shed(candidates: Sequence[WorkerView], cfg: ShedConfig, queued: int = 0) -> ShedDecision:
    """Decide whether a request can be routed now.

    Args:
        candidates: serving workers for the request's model and pool.
        cfg: thresholds and mode.
        queued: requests already in the router's queue. In ``queue`` mode a
            new request is queued (not routed) while ``queued > 0`` and the
            queue has room, so queued requests keep their order.

    Returns:
        ``route`` with the non-busy candidates; otherwise ``reject`` (with
        ``Retry-After``) or ``queue``. With no candidates at all, ``reject``
        with reason ``"no worker"``.
    """
    if not candidates:
        return ShedDecision(ShedAction.reject, retry_after_s=cfg.retry_after_min_s, reason="no worker")
    free = tuple(w for w in candidates if not is_busy(w, cfg))
    queue_mode = cfg.mode is ShedMode.queue
    if free:
        if queue_mode and 0 < queued < cfg.queue_capacity:
            return ShedDecision(ShedAction.queue, reason="earlier requests are queued")
        return ShedDecision(ShedAction.route, candidates=free)
    if queue_mode and queued < cfg.queue_capacity:
        return ShedDecision(ShedAction.queue, reason="all workers busy")
    reason = "all workers busy and the queue is full" if queue_mode else "all workers busy"
    return ShedDecision(ShedAction.reject, retry_after_s=retry_after_s(candidates, cfg, queued), reason=reason)


def has_free_worker(candidates: Sequence[WorkerView], cfg: ShedConfig) -> bool:
    """Whether some candidate is not busy, i.e. a queued request may be released.

    Heartbeats lag: release at most one queued request per non-busy worker
    per heartbeat, or a release burst lands on a worker still shown as free.
    """
    return any(not is_busy(w, cfg) for w in candidates)


class QueueFull(OverflowError):
    """:meth:`BoundedRequestQueue.push` on a full queue; answer 503 with Retry-After."""


@dataclass
class BoundedRequestQueue(Generic[T]):
    """A bounded queue of waiting requests, FCFS or shortest-ISL-first.

    ``sjf`` releases the smallest ISL first, ties in arrival order; it can
    starve long prompts under sustained overload (bounded by ``capacity`` and
    by request deadlines, see :meth:`pop_expired`).

    Args:
        capacity: most items held (>= 1).
        order: ``fcfs`` or ``sjf``.

    Raises:
        ValueError: ``capacity < 1`` or an unknown order.
    """

    capacity: int
    order: QueueOrder = QueueOrder.fcfs
    _heap: list[tuple[Any, int, int | None, T]] = field(init=False, default_factory=list)
    _seq: Any = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        self.order = QueueOrder(self.order)

    def push(self, item: T, isl: int = 0, deadline_ms: int | None = None, *, priority: int = 0,
             tenant: str = "") -> None:
        """Queue ``item`` (ISL in tokens; optional absolute deadline in ms;
        ``priority`` and ``tenant`` are ignored by these orders).

        Raises:
            QueueFull: ``capacity`` items are already queued.
        """
        if len(self._heap) >= self.capacity:
            raise QueueFull(f"request queue full ({self.capacity})")
        seq = next(self._seq)
        key = isl if self.order is QueueOrder.sjf else 0
        heapq.heappush(self._heap, (key, seq, deadline_ms, item))

    def pop(self) -> T:
        """Remove and return the next item.

        Raises:
            IndexError: the queue is empty.
        """
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[3]

    def peek(self) -> T:
        """The next item, left in place.

        Raises:
            IndexError: the queue is empty.
        """
        if not self._heap:
            raise IndexError("peek at an empty request queue")
        return self._heap[0][3]

    def pop_expired(self, now_ms: int) -> list[T]:
        """Remove and return items whose deadline is <= ``now_ms`` (in release order)."""
        expired = [e for e in self._heap if e[2] is not None and e[2] <= now_ms]
        if not expired:
            return []
        self._heap = [e for e in self._heap if e[2] is None or e[2] > now_ms]
        heapq.heapify(self._heap)
        expired.sort(key=lambda e: (e[0], e[1]))
        return [e[3] for e in expired]

    def remove(self, matches: Callable[[T], bool]) -> list[T]:
        """Remove and return the items for which ``matches(item)`` is true, in release order (O(len))."""
        keep: list = []
        gone: list = []
        for e in self._heap:
            (gone if matches(e[3]) else keep).append(e)
        if not gone:
            return []
        self._heap = keep
        heapq.heapify(keep)
        gone.sort(key=lambda e: (e[0], e[1]))
        return [e[3] for e in gone]

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
