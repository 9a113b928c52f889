"""Exact in-flight load: what each worker holds, between two heartbeats.

A heartbeat is a snapshot of a worker's engine (running and waiting
requests, prompt tokens still to prefill) taken every
``heartbeat_interval_ms``. On its own it leaves the router wrong in both
directions until the next one: a request routed after it is missing from
it, and a request that finished after it still counts. With a 1 s period,
a worker that has just served a prompt looks busier than an idle one, so a
repeated prompt is sent away from the only worker caching its prefix.

Stream: workers publish a compact record on the ``inflight`` topic when
they take a request from their queue (:class:`~kvflow.schemas.RequestAdmitted`)
and when it ends there (:class:`~kvflow.schemas.RequestFinished`: finished,
failed, stopped or cancelled alike), keyed by worker id, numbered per worker
incarnation by ``seq``. Every router replica reads the whole topic
(:func:`kvflow.router.projections.follow_topics`), so the requests every
worker holds are a fold of one log, the same on every replica, including
requests another replica routed. Why the worker publishes admissions too,
and not only completions: replicas of a router split the request stream
(one consumer group), so a replica's own decisions are not the log; a
completions-only stream would leave each replica counting only what it
routed itself, and nothing would tell a heartbeat's figures apart from the
records that came after it. Why not read the queue topics instead: they
carry whole prompts (tens of kB per request) over 64 partitions per pool;
an admission record is ~200 bytes. The router still adds its own decisions
at once (:func:`note_routed_request`), so a burst is spread before any
record comes back; the worker's admission record then takes the entry over.

State per worker (:class:`WorkerInflight`), all of it keyed by request id:

* ``routed``: requests this router sent and the worker has not yet
  admitted (provisional);
* ``admitted``: requests the worker took and has not ended;
* the last heartbeat of the incarnation, whose ``lifecycle_seq`` says which
  admitted requests its figures include (``seq < lifecycle_seq``: covered)
  and which came after it (uncovered).

Load figures written into the routing table's
:class:`~kvflow.router.table.WorkerView` (the reconciliation; ``hb`` = the
heartbeat, ``covered`` = covered admitted requests still held)::

    active_requests       = min(hb.active_requests, |covered|)
    waiting_requests      = min(hb.waiting_requests, |covered| − active_requests)
    active_prefill_tokens = hb.active_prefill_tokens, or, once a covered request ended since hb,
                            min(hb.active_prefill_tokens, Σ covered prompt tokens)
    routed_since_heartbeat = |uncovered admitted| + |routed|
    routed_prefill_tokens  = Σ prefill_tokens over uncovered admitted and routed requests
    stall_exposure         = Σ 1 / (max_tokens − 1) over every admitted and routed request
                             (those with max_tokens ≤ 1 add 0; see :func:`stall_exposure`)

so nothing is counted twice: a request is either in the heartbeat's
figures or in the ``routed_*`` terms, never both, and a request that ended
leaves both at once. The ``min`` bounds are kvflow's: a heartbeat's
figures cannot belong to requests no longer held (a finished request's
prompt is computed; the running count cannot exceed the requests left).
The prefill bound applies only after a covered request ended, because an
engine recomputing a preempted request can report more pending tokens than
its prompt. "Covered" is exact for records, approximate for the engine: a
request whose admission record precedes the heartbeat but which the worker
has not yet handed to its engine (microseconds; a decode stage waiting for
its KV) is in neither figure until the next heartbeat. With a fresh
heartbeat and every record folded, the figures are the heartbeat's own
(which is why the offline simulator, refreshing heartbeats before every
decision, routes exactly as before). Replicas that have read the same
records and heartbeats hold the same figures whatever order they read the
two topics in (with a lost record, until the next heartbeat's check); they
differ only by their own provisional entries, each until the worker's
admission record of it is read (milliseconds).

Fallbacks, so a lost record cannot leave load behind:

* a provisional entry the worker never admits expires ``ttl_ms`` (the
  worker's heartbeat TTL) after it was routed (:func:`expire_inflight`);
* a heartbeat carries ``inflight_requests``, the requests the worker held;
  once every record before it (``seq < lifecycle_seq``) is folded, covered
  entries beyond that count are finish records that never came, and the
  oldest of them are dropped (:attr:`InflightTracker.reconciled`);
* a worker that stops, expires or restarts (new ``started_ms``) takes its
  admitted entries with it; records of an older incarnation are ignored.

KV events of a finished request: the worker flushes its pending KV event
batches before it publishes the finish record, which carries the next
batch id (``kv_event_id``); :func:`kv_lagging` names the workers whose
finished requests' KV the router's index has not folded yet, so the router
can wait for them (briefly) before it routes the next request.

A worker whose heartbeat has no ``lifecycle_seq`` (it publishes no
inflight records) is counted as before: requests routed to it count until
its next heartbeat (:func:`kvflow.router.table.note_routed`).

Pure state and functions: no I/O, no clock (times are passed in), so the
router, its replicas and :mod:`kvflow.replay.simulator` share them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvflow.schemas import RequestAdmitted, RequestFinished, WorkerHeartbeat

if TYPE_CHECKING:
    from kvflow.router.table import RoutingTable

__all__ = [
    "DEFAULT_TTL_MS",
    "EXPOSURE_UNIT",
    "FINISHED_REMEMBERED",
    "ORPHAN_TTL_MS",
    "InflightEntry",
    "InflightTracker",
    "WorkerInflight",
    "apply_inflight_record",
    "expire_inflight",
    "forget_worker",
    "kv_lagging",
    "note_routed_request",
    "observe_heartbeat",
    "refresh_view",
    "stall_exposure",
    "waive_kv",
]

FINISHED_REMEMBERED = 1024
"""Ended request ids remembered per worker, so an admission record read after
its request's finish record (a producer retry) does not count it again."""

ORPHAN_TTL_MS = 60_000
"""State of a worker absent from the routing table is dropped once its last
record is this old (a router replaying the topic meets workers long gone)."""

DEFAULT_TTL_MS = 5000
"""Expiry of a provisional entry of a worker the table does not hold (the
heartbeat's default ``ttl_ms``)."""


@dataclass(slots=True)
class InflightEntry:
    """One request a worker holds or is about to hold.

    ``prompt_tokens``: prompt length (0 = unknown); ``prefill_tokens``:
    prompt tokens the worker is expected to compute; ``since_ms``: when it
    was routed (router clock, provisional entries) or admitted (worker
    clock); ``seq``: its admission record's ``seq``, None while provisional;
    ``max_tokens``: the most output tokens the worker decodes for it (0 =
    none or unknown).
    """

    request_id: str
    prompt_tokens: int
    prefill_tokens: int
    since_ms: int
    seq: int | None = None
    max_tokens: int = 0


EXPOSURE_UNIT = 1_000_000
"""Stall exposure is summed in integer millionths (exact under add and remove)."""


def stall_exposure(max_tokens: int) -> float:
    """How much one ms of prefill placed beside a request stretches its mean
    inter-token latency (ms per ms, i.e. ``1 / (max_tokens − 1)``): a stall
    of ``t`` ms between two of its tokens adds ``t / (osl − 1)`` to the mean
    gap over its ``osl − 1`` gaps (AIPerf's per-request ITL). ``max_tokens``
    is the output cap, an upper bound of ``osl``, so this is a lower bound.
    0 when the request decodes at most one token (no gap to stretch)."""
    return 1.0 / (max_tokens - 1) if max_tokens > 1 else 0.0


def _exposure_micro(max_tokens: int) -> int:
    return round(EXPOSURE_UNIT * stall_exposure(max_tokens))


@dataclass(slots=True)
class _Sums:
    """Running totals over a set of entries (requests, prompt tokens, unknown prompts, prefill tokens,
    stall exposure in :data:`EXPOSURE_UNIT` parts)."""

    n: int = 0
    prompt: int = 0
    unknown: int = 0
    prefill: int = 0
    exposure: int = 0

    def add(self, e: InflightEntry, sign: int = 1) -> None:
        self.n += sign
        self.prompt += sign * e.prompt_tokens
        self.unknown += sign * (e.prompt_tokens == 0)
        self.prefill += sign * e.prefill_tokens
        self.exposure += sign * _exposure_micro(e.max_tokens)


@dataclass
class WorkerInflight:
    """What one worker holds (see the module docstring).

    Attributes:
        started_ms: the incarnation folded (-1 before any record or heartbeat).
        routed: provisional entries, in routing order.
        admitted: admitted entries, in record order.
        finished: recently ended request ids (at most :data:`FINISHED_REMEMBERED`).
        heartbeat: the incarnation's last heartbeat with a ``lifecycle_seq``.
        seq_read: one past the highest record ``seq`` folded.
        covered_finished: covered requests that ended since ``heartbeat``.
        check: ``(lifecycle_seq, inflight_requests)`` of a heartbeat whose
            records are not all folded yet (the leak check waits for them).
        kv_event_id: highest ``kv_event_id`` of the finish records folded.
        kv_waived: ``(index cursor,)`` when the router stopped waiting for
            this worker's KV events at that cursor (see :func:`waive_kv`).
        last_ms: latest record or routing time seen (orphan expiry).
    """

    started_ms: int = -1
    routed: OrderedDict[str, InflightEntry] = field(default_factory=OrderedDict)
    admitted: OrderedDict[str, InflightEntry] = field(default_factory=OrderedDict)
    finished: OrderedDict[str, None] = field(default_factory=OrderedDict)
    heartbeat: WorkerHeartbeat | None = None
    seq_read: int = 0
    covered_finished: int = 0
    check: tuple[int, int] | None = None
    kv_event_id: int = 0
    kv_waived: tuple[int | None] | None = None
    last_ms: int = 0
    _all: _Sums = field(default_factory=_Sums)  # over admitted
    _new: _Sums = field(default_factory=_Sums)  # over uncovered admitted
    _routed: _Sums = field(default_factory=_Sums)  # over routed

    @property
    def covered_seq(self) -> int:
        """Admitted entries with ``seq`` below this are in the heartbeat's figures (0 without one)."""
        return self.heartbeat.lifecycle_seq if self.heartbeat is not None else 0

    def held(self) -> int:
        """Requests counted on this worker: admitted plus provisional."""
        return len(self.admitted) + len(self.routed)

    def figures(self) -> tuple[int, int, int, int, int, float]:
        """``(active_requests, waiting_requests, active_prefill_tokens, routed_since_heartbeat,
        routed_prefill_tokens, stall_exposure)`` by the formulas of the module docstring.

        Raises:
            ValueError: no heartbeat folded yet.
        """
        hb = self.heartbeat
        if hb is None:
            raise ValueError("no heartbeat folded for this worker")
        cov_n = self._all.n - self._new.n
        running = min(hb.active_requests, cov_n)
        waiting = min(hb.waiting_requests, cov_n - running)
        prefill = hb.active_prefill_tokens
        if self.covered_finished and self._all.unknown == self._new.unknown:
            prefill = min(prefill, self._all.prompt - self._new.prompt)
        return (running, waiting, prefill, self._new.n + self._routed.n, self._new.prefill + self._routed.prefill,
                (self._all.exposure + self._routed.exposure) / EXPOSURE_UNIT)

    def _recount(self) -> None:
        """Recompute the uncovered sums after the coverage boundary moved (newest entries first)."""
        self._new = _Sums()
        boundary = self.covered_seq
        if self.seq_read <= boundary:
            return
        for e in self.admitted.values():  # only when records came after the heartbeat (O(held), ~1/s)
            if e.seq >= boundary:
                self._new.add(e)

    def _drop_admitted(self, request_id: str) -> InflightEntry | None:
        e = self.admitted.pop(request_id, None)
        if e is not None:
            self._all.add(e, -1)
            if e.seq >= self.covered_seq:
                self._new.add(e, -1)
            else:
                self.covered_finished += 1
        return e

    def _drop_routed(self, request_id: str) -> InflightEntry | None:
        e = self.routed.pop(request_id, None)
        if e is not None:
            self._routed.add(e, -1)
        return e

    def _new_incarnation(self, started_ms: int) -> None:
        self.started_ms = started_ms
        self.admitted.clear()
        self.finished.clear()
        self.heartbeat = None
        self.seq_read = 0
        self.covered_finished = 0
        self.check = None
        self.kv_event_id = 0
        self.kv_waived = None
        self._all = _Sums()
        self._new = _Sums()


@dataclass
class InflightTracker:
    """Every worker's :class:`WorkerInflight`, by worker id.

    ``reconciled`` counts entries dropped because a heartbeat showed their
    finish record would never come; ``expired`` counts provisional entries
    dropped at their TTL.
    """

    workers: dict[str, WorkerInflight] = field(default_factory=dict)
    reconciled: int = 0
    expired: int = 0

    def state(self, worker_id: str) -> WorkerInflight:
        """The worker's state, created empty on first use."""
        s = self.workers.get(worker_id)
        if s is None:
            s = self.workers[worker_id] = WorkerInflight()
        return s


def refresh_view(table: RoutingTable, worker_id: str) -> None:
    """Write ``worker_id``'s reconciled load figures into its view in ``table``
    (nothing when the worker has no view or no tracked heartbeat)."""
    view = table.workers.get(worker_id)
    s = table.inflight.workers.get(worker_id)
    if view is None or s is None or s.heartbeat is None:
        return
    active, waiting, prefill, routed, routed_prefill, exposure = s.figures()
    table.workers[worker_id] = replace(view, active_requests=active, waiting_requests=waiting,
                                       active_prefill_tokens=prefill, routed_since_heartbeat=routed,
                                       stall_exposure=exposure,
                                       routed_prefill_tokens=routed_prefill)


def _check_leaks(tracker: InflightTracker, s: WorkerInflight) -> None:
    """Drop covered entries beyond the heartbeat's ``inflight_requests`` once its records are folded."""
    if s.check is None or s.seq_read < s.check[0]:
        return
    boundary, held = s.check
    s.check = None
    if boundary == s.covered_seq and s._all.n - s._new.n <= held:
        return  # the covered entries are no more than the worker held (the usual case, O(1))
    covered = [e for e in s.admitted.values() if e.seq < boundary]
    excess = len(covered) - held
    if excess <= 0:
        return
    for e in sorted(covered, key=lambda e: e.seq)[:excess]:
        s._drop_admitted(e.request_id)
        tracker.reconciled += 1


def observe_heartbeat(table: RoutingTable, hb: WorkerHeartbeat) -> None:
    """Fold a heartbeat the table accepted into the tracker (called by
    :func:`kvflow.router.table.apply_heartbeat`, which then calls :func:`refresh_view`).

    A heartbeat without ``lifecycle_seq`` drops the worker's state (it
    publishes no records); one of an older incarnation than the records
    folded is ignored; one of a newer incarnation drops the admitted
    entries of the old one (provisional entries stay: the new incarnation
    consumes the same queue slot).
    """
    tracker = table.inflight
    if hb.lifecycle_seq is None:
        tracker.workers.pop(hb.worker_id, None)
        return
    s = tracker.state(hb.worker_id)
    if hb.started_ms < s.started_ms:
        return
    if hb.started_ms > s.started_ms:
        s._new_incarnation(hb.started_ms)
    s.heartbeat = hb
    s.covered_finished = 0
    s._recount()
    s.check = (hb.lifecycle_seq, hb.inflight_requests) if hb.inflight_requests is not None else None
    _check_leaks(tracker, s)


def forget_worker(table: RoutingTable, worker_id: str) -> None:
    """Drop everything ``worker_id`` held (it stopped or expired)."""
    table.inflight.workers.pop(worker_id, None)


def note_routed_request(table: RoutingTable, worker_id: str, request_id: str, *, prompt_tokens: int,
                        prefill_tokens: int, now_ms: int, max_tokens: int = 0) -> None:
    """Count a request this router just sent to ``worker_id`` (a provisional entry).

    ``prompt_tokens``: its prompt length (0 = unknown); ``prefill_tokens``:
    the prompt tokens the worker is expected to compute (prompt minus the
    cached overlap; 0 for a decode worker importing the KV); ``now_ms``:
    the decision time (expiry starts there); ``max_tokens``: the most
    output tokens the worker decodes for it (0 for a remote prefill, and
    when unknown). A worker without tracked
    heartbeats is counted the old way (``routed_since_heartbeat + 1``); a
    request already counted on the worker is not counted again. Unknown
    workers are ignored.
    """
    view = table.workers.get(worker_id)
    if view is None:
        return
    s = table.inflight.workers.get(worker_id)
    if s is None or s.heartbeat is None:
        table.workers[worker_id] = replace(view, routed_since_heartbeat=view.routed_since_heartbeat + 1)
        return
    if request_id in s.admitted or request_id in s.routed:
        return
    e = InflightEntry(request_id, max(0, prompt_tokens), max(0, prefill_tokens), now_ms, None, max(0, max_tokens))
    s.routed[request_id] = e
    s._routed.add(e)
    s.last_ms = max(s.last_ms, now_ms)
    refresh_view(table, worker_id)


def apply_inflight_record(table: RoutingTable, record: RequestAdmitted | RequestFinished) -> None:
    """Fold one inflight-topic record into the tracker and the worker's view.

    Admitted: the worker holds the request (taking over this router's
    provisional entry; a duplicate, or an admission of a request already
    ended and not routed again, is ignored). Finished: the request leaves
    the worker, whichever set held it; its id is remembered
    (:data:`FINISHED_REMEMBERED`). Records of an older incarnation than
    the one folded are ignored; a newer one drops the old incarnation's
    admitted entries.
    """
    tracker = table.inflight
    s = tracker.state(record.worker_id)
    if record.started_ms < s.started_ms:
        return
    if record.started_ms > s.started_ms:
        s._new_incarnation(record.started_ms)
    s.seq_read = max(s.seq_read, record.seq + 1)
    s.last_ms = max(s.last_ms, record.ts_ms)
    rid = record.request_id
    if isinstance(record, RequestAdmitted):
        provisional = s._drop_routed(rid)
        if rid not in s.admitted and (provisional is not None or rid not in s.finished):
            e = InflightEntry(rid, record.prompt_tokens, record.prefill_tokens, record.ts_ms, record.seq,
                              record.max_tokens)
            s.admitted[rid] = e
            s._all.add(e)
            if e.seq >= s.covered_seq:
                s._new.add(e)
            s.finished.pop(rid, None)
    else:
        s._drop_routed(rid)
        s._drop_admitted(rid)
        s.finished[rid] = None
        s.finished.move_to_end(rid)
        while len(s.finished) > FINISHED_REMEMBERED:
            s.finished.popitem(last=False)
        s.kv_event_id = max(s.kv_event_id, record.kv_event_id)
    _check_leaks(tracker, s)
    refresh_view(table, record.worker_id)


def expire_inflight(table: RoutingTable, now_ms: int) -> list[str]:
    """Drop provisional entries older than their worker's ``ttl_ms`` (never
    admitted), and the state of workers absent from the table whose last
    record is older than :data:`ORPHAN_TTL_MS`. Returns the request ids of
    the expired entries.

    Cost: the oldest provisional entries of each worker, until one is young
    enough, plus one check per worker.
    """
    tracker = table.inflight
    gone: list[str] = []
    for worker_id in list(tracker.workers):
        s = tracker.workers[worker_id]
        view = table.workers.get(worker_id)
        if view is None and not s.routed and now_ms - s.last_ms > ORPHAN_TTL_MS:
            del tracker.workers[worker_id]
            continue
        ttl = view.ttl_ms if view is not None else DEFAULT_TTL_MS
        expired = []
        for rid, e in s.routed.items():
            if now_ms - e.since_ms <= ttl:
                break
            expired.append(rid)
        for rid in expired:
            s._drop_routed(rid)
        if expired:
            tracker.expired += len(expired)
            gone.extend(expired)
            refresh_view(table, worker_id)
    return gone


def kv_lagging(table: RoutingTable, last_event_id: Callable[[str], int | None],
               worker_ids: Iterable[str] | None = None) -> list[str]:
    """Workers whose finished requests' KV events the index has not folded yet.

    ``last_event_id(worker_id)``: the index's cursor (the last batch id
    applied, None when none). A worker lags when a finish record said
    ``kv_event_id`` batches came before it and the cursor is below
    ``kv_event_id - 1``, unless :func:`waive_kv` gave up on it at the
    current cursor. ``worker_ids`` restricts the check (default: every
    tracked worker), sorted.
    """
    tracker = table.inflight
    ids = tracker.workers if worker_ids is None else worker_ids
    lagging = []
    for worker_id in ids:
        s = tracker.workers.get(worker_id)
        if s is None or s.kv_event_id <= 0:
            continue
        cursor = last_event_id(worker_id)
        if (cursor is None or cursor < s.kv_event_id - 1) and s.kv_waived != (cursor,):
            lagging.append(worker_id)
    return sorted(lagging)


def waive_kv(table: RoutingTable, worker_id: str, cursor: int | None) -> None:
    """Stop waiting for ``worker_id``'s KV events while the index cursor stays at ``cursor``
    (the router waited long enough; a worker whose batches the index refuses
    must not delay every decision)."""
    s = table.inflight.workers.get(worker_id)
    if s is not None:
        s.kv_waived = (cursor,)
