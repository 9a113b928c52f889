"""Adaptive fetch long-poll for consumers of the embedded broker.

Tansu (the embedded broker) answers a fetch when ``fetch_max_wait_ms`` runs
out, not when records arrive, and it returns *nothing* when it cannot
assemble the records in the partition within that time. A fixed wait is
therefore wrong both ways:

- a short wait (5 ms) keeps latency low but makes every idle consumer send
  ~200 fetches/s, which kept the broker at ~80% of a core with no traffic,
  and a consumer that falls a few thousand records behind on a busy broker
  gets empty answers for ever (measured: at 35,544 of 112,766 records the
  bridge's responses reader received nothing for minutes; a fresh consumer
  at the same offset got 0 records with a 5 ms wait and 942 with 20 ms);
- a long wait costs that much latency on every hop.

:class:`FetchWaitPolicy` picks the wait before each fetch request from what
the consumer knows: behind the high watermark → ``catch_up_ms`` (room to
assemble records), unless that partition's position has not moved for
``stuck_after_s`` (Tansu leaves some partitions one record short of their
watermark for ever, e.g. a Faust changelog partition at 0 of 1; the response
reader's supervisor handles a reader that is really stuck); records on a latency-critical ("hot") partition within
``active_window_s`` → ``active_ms``; otherwise a wait that doubles for every
further second of quiet, from ``active_ms`` up to ``idle_ms`` (straight to
``idle_ms`` for a consumer every writer rings, :attr:`FetchWaitPolicy.rung`). The first
record after a quiet spell therefore pays up to the current wait on each hop
whose consumer was idle (at most ``idle_ms`` after a long one); under
traffic every hop runs at ``active_ms``.

A consumer parked in a long poll can be woken: :func:`wake` /
:func:`wake_policy` (a request was just sent whose answer or side effects
this consumer will read) and :func:`produced` (a record was just written to
a topic the consumer reads) cut its in-flight fetch short, by cancelling it
and closing its connection (the broker answers a connection's requests in
order, so a new fetch on it would queue behind the parked one); the next
fetch goes out at once on a fresh connection. :func:`produced` also rings
the other processes of the host (:mod:`kvflow.streams.doorbell`), which run
:func:`woken` for their own consumers. A seek, an offset reset or an offset
lookup (end, beginning, by time) cuts a parked fetch too (aiokafka sends the
first two only after the fetch in flight, and a lookup on the connection that
fetch holds, which the broker answers in order). So only a hop
that no writer rings pays the idle wait, once, on the first record after a
quiet spell; ``busy`` (e.g. a client with streams in flight) keeps a
consumer from parking at all.

:func:`install` attaches a policy to a started aiokafka consumer; the fetcher
hook (:func:`patch_fetcher`) reads it. Consumers without a policy keep their
fixed ``fetch_max_wait_ms``. On a real Kafka cluster no policy is installed:
the broker answers a long-poll as soon as data arrives.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FetchWaitPolicy", "PartitionState", "install", "patch_fetcher", "wake", "wake_policy", "produced",
           "woken", "STALE_RECHECK_S"]

PartitionState = tuple[Any, int | None, int | None]
"""One assigned partition as the policy sees it: (topic-partition with a
``.topic``, fetch position or None, last known high watermark or None)."""


@dataclass
class FetchWaitPolicy:
    """Chooses the fetch long-poll (ms) of one consumer.

    ``hot`` says which topics' new records count as activity (None: all);
    heartbeats and other background topics should not keep a consumer in
    its fast mode. Time is passed in (monotonic seconds), never read here.
    """

    active_ms: int = 5
    idle_ms: int = 200
    catch_up_ms: int = 250
    active_window_s: float = 2.0
    stuck_after_s: float = 5.0
    hot: Callable[[str], bool] | None = None
    busy: Callable[[], bool] | None = None
    """True while the consumer's process waits on records it will read (e.g.
    a client with streams in flight): counts as activity, so the consumer
    never parks in a long poll then. None: never busy."""
    idle_cap: Callable[[], int] | None = None
    """Called before each quiet-spell fetch: the most that wait may be now (ms),
    e.g. the bound a heartbeat reader needs to see beats before workers
    expire (:func:`kvflow.streams.workers.liveness_wait`). None: ``idle_ms``."""
    rung: bool = False
    """Every writer of the records that make this consumer active rings it
    (:func:`produced`; e.g. a worker's queue, which only routers and
    forwarding workers write): once its active window has passed it parks at
    ``idle_ms`` at once instead of stepping the wait up from ``active_ms``.
    On a sparse topic (a request every few seconds per worker) that is a
    handful of fetches per record instead of one per ``active_ms``."""
    cut_above_ms: int = 50
    """A wake cuts short an in-flight fetch sent with a longer wait than this."""
    sent_ms: int = 0
    """Wait of the consumer's latest fetch request actually sent if it was a
    quiet-spell wait, else 0 (set by the fetcher hook). A catch-up wait is
    never cut: the broker needs that time to assemble the records, and a
    consumer whose catch-up fetches were cut on every request sent (the
    bridge's reader under overload) never caught up."""
    quiet: bool = False
    """Whether the wait :meth:`wait_ms` last returned is a quiet-spell wait."""
    cut: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Aborts the consumer's in-flight fetch (set by :func:`install`)."""
    _last_hw: dict[Any, int] = field(default_factory=dict)
    _moved: dict[Any, tuple[int, float]] = field(default_factory=dict)  # tp -> (position, when it last changed)
    _last_activity: float = -math.inf

    def wake(self, now: float) -> bool:
        """Count ``now`` as activity (e.g. a client just sent a request whose
        answer this consumer will read). Returns True when the fetch in
        flight was sent with a wait above ``cut_above_ms``: the broker will
        hold it that long, so it is worth cutting short (:func:`wake_policy`)."""
        self._last_activity = max(self._last_activity, now)
        return self.sent_ms > self.cut_above_ms

    def wait_ms(self, partitions: Iterable[PartitionState], now: float) -> int:
        """The wait for the next fetch request, ms.

        ``partitions`` are the consumer's assigned partitions. A hot
        partition whose high watermark grew since the last call marks
        activity; a partition with ``position < highwater`` whose position
        moved within ``stuck_after_s`` is behind.
        """
        behind = False
        for tp, position, highwater in partitions:
            if highwater is None:
                continue
            if position is not None:
                moved = self._moved.get(tp)
                if moved is None or moved[0] != position:
                    moved = self._moved[tp] = (position, now)
                if position < highwater and now - moved[1] < self.stuck_after_s:
                    behind = True
            last = self._last_hw.get(tp)
            self._last_hw[tp] = highwater
            if last is not None and highwater > last and (self.hot is None or self.hot(tp.topic)):
                self._last_activity = now
        if self.busy is not None and self.busy():
            self._last_activity = now
        quiet = now - self._last_activity - self.active_window_s
        self.quiet = not behind and quiet >= 0
        if behind:
            return self.catch_up_ms
        if quiet < 0:
            return self.active_ms
        wait = self.idle_ms if self.rung or quiet >= 32 else int(min(self.idle_ms, self.active_ms * 2 ** quiet))
        return wait if self.idle_cap is None else min(wait, self.idle_cap())


def _states(assignment: Any) -> list[PartitionState]:
    out = []
    for tp in assignment.tps:
        st = assignment.state_value(tp)
        out.append((tp, st.position if st.has_valid_position else None, st.highwater))
    return out


def patch_fetcher() -> None:
    """Make aiokafka's fetcher ask a consumer's :class:`FetchWaitPolicy` (if
    one is installed) for the wait of each fetch request. Idempotent.

    The hook wraps ``Fetcher._get_actions_per_node`` (aiokafka 0.11–0.14),
    which builds the fetch requests from ``self._fetch_max_wait_ms``.
    """
    from aiokafka.consumer.fetcher import Fetcher

    if getattr(Fetcher, "_kvflow_adaptive", False):
        return
    original = Fetcher._get_actions_per_node

    @functools.wraps(original)
    def _get_actions_per_node(self: Any, assignment: Any) -> Any:
        policy = getattr(self, "_kvflow_wait", None)
        if self._in_flight and all(task.done() for task in self._pending_tasks):
            # The fetch ended (e.g. cut short) but its done callback, which clears the in-flight
            # mark, has not run yet: the routine would send nothing and sleep its whole tick
            # (FETCHER_TIMEOUT_MS). Look again as soon as that callback has run.
            fetches, resets, _, invalid, resumes = original(self, assignment)
            return fetches, resets, STALE_RECHECK_S, invalid, resumes
        if policy is None or self._in_flight:
            # In flight: no fetch goes out now, and the answer brings what the policy reads.
            return original(self, assignment)
        self._fetch_max_wait_ms = policy.wait_ms(_states(assignment), time.monotonic())
        actions = original(self, assignment)
        if actions[0]:  # fetch requests about to be sent
            policy.sent_ms = self._fetch_max_wait_ms if policy.quiet else 0
        return actions

    Fetcher._get_actions_per_node = _get_actions_per_node

    # A seek or offset reset waits for the in-flight fetch (aiokafka sends one request at a
    # time per broker): cut a parked one, or a worker positioning its partitions at start-up
    # would wait out each idle poll in turn.
    def cutting(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            wake_policy(getattr(self, "_kvflow_wait", None))
            return result
        return wrapper

    Fetcher.request_offset_reset = cutting(Fetcher.request_offset_reset)
    Fetcher.seek_to = cutting(Fetcher.seek_to)

    # An offset lookup (end_offsets, beginning_offsets, offsets_for_times) goes out on the
    # connection a parked fetch holds and would be answered only after it: cut that fetch
    # first (a worker at start-up looked up its cancels' ends behind a 30 s idle poll).
    def cutting_first(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            wake_policy(getattr(self, "_kvflow_wait", None))
            return await method(self, *args, **kwargs)
        return wrapper

    for name in ("end_offsets", "beginning_offsets", "get_offsets_by_times"):
        setattr(Fetcher, name, cutting_first(getattr(Fetcher, name)))
    Fetcher._kvflow_adaptive = True


def install(consumer: Any, policy: FetchWaitPolicy) -> FetchWaitPolicy:
    """Attach ``policy`` to a *started* aiokafka consumer; returns it.

    The consumer is also registered for :func:`produced` (same-process wake
    ups), and ``policy.cut`` is set to abort its in-flight fetch.

    Raises:
        RuntimeError: the consumer is not started (it has no fetcher yet).
    """
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None:
        raise RuntimeError("install a fetch-wait policy after the consumer has started")
    patch_fetcher()
    policy._last_activity = max(policy._last_activity, time.monotonic())  # positioning at start: poll fast
    fetcher._kvflow_wait = policy
    loop = fetcher._loop
    policy.cut = functools.partial(_cut_threadsafe, loop, weakref.ref(consumer))
    _local[consumer] = policy
    return policy


def _cut_threadsafe(loop: asyncio.AbstractEventLoop, ref: Callable[[], Any]) -> None:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _cut(ref)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(_cut, ref)  # faust runs its consumer on its own thread's loop


def _waiting_on_the_broker(task: asyncio.Task) -> bool:
    """Whether a fetch task is suspended in its request to the broker, the one
    place where aiokafka's fetch coroutine turns a cancellation into "no data"."""
    awaited = getattr(task.get_coro(), "cr_await", None)
    return getattr(awaited, "__qualname__", "") == "AIOKafkaClient.send"


_CUT_RETRIES = 20

STALE_RECHECK_S = 0.001
"""Sleep of a consumer's fetch routine (s) when it finds a node marked in
flight with no fetch task left running. aiokafka clears the mark in the
task's done callback, and after a cut (:func:`wake`, :func:`produced`) the
routine was seen to run before that callback: it then sent no fetch and slept
its whole tick (2 s). On the Mooncake slice that held 1-23 requests for ~2 s
on one hop in 12 of 17 runs, and in none of 2 runs after this fix
(docs/benchmarks.md, "Requests that waited 2 s on one hop")."""


def _cut(ref: Callable[[], Any], retries: int = _CUT_RETRIES) -> None:
    """Abort ``consumer``'s in-flight fetch so its next one goes out now.

    The broker answers requests on one connection in order, so cancelling
    the fetch task is not enough: the connection it waits on is closed too
    and the next fetch opens a fresh one (a few ms on localhost). Only a
    fetch task suspended in its broker request is cancelled: cancelling one
    that has not started yet (or that sleeps after an error) makes its
    result raise, which ends aiokafka's fetch routine for good (the consumer
    then never fetches again). Such a task is retried on the next loop turns.
    """
    consumer = ref()
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or not fetcher._in_flight:
        return
    from aiokafka.client import ConnectionGroup
    from aiokafka.conn import CloseReason

    tasks = [t for t in fetcher._pending_tasks if not t.done()]
    if not tasks or any(t.get_coro().__qualname__ != "Fetcher._proc_fetch_request" for t in tasks):
        return  # e.g. a position reset in flight (start-up): cancelling it would stall those partitions
    if not all(_waiting_on_the_broker(t) for t in tasks):
        if retries > 0:
            fetcher._loop.call_later(0.002, _cut, ref, retries - 1)
        return
    nodes = set(fetcher._in_flight)
    for task in tasks:
        task.cancel()  # the fetcher treats a cancelled fetch as "no data" and sends the next one
    for (node, group), conn in list(consumer._client._conns.items()):
        if group == ConnectionGroup.DEFAULT and node in nodes:
            conn.close(reason=CloseReason.IDLE_DROP)  # IDLE_DROP: no metadata refresh
    policy = getattr(fetcher, "_kvflow_wait", None)
    if policy is not None:
        policy.sent_ms = 0


def wake_policy(policy: FetchWaitPolicy | None) -> None:
    """Mark activity on ``policy`` now and, if its consumer is parked in a
    long fetch, cut that fetch short (safe from any thread)."""
    if policy is not None and policy.wake(time.monotonic()) and policy.cut is not None:
        policy.cut()


def produced(topic: str, partition: int | None = None) -> None:
    """Tell the adaptive consumers of ``topic`` (``partition``, or None for
    any) that a record was just sent there: any of them parked in a long
    fetch wakes and cuts it short, in this process (:func:`woken`) and, on
    the embedded broker, in the other processes of this host
    (:func:`kvflow.streams.doorbell.ring`).

    So the first record after a quiet spell does not wait out an idle
    consumer's long poll on the hop it takes. Cheap: a look at each local
    consumer's assignment, and at most one ring per partition
    per :data:`~kvflow.streams.doorbell.RING_GAP_S`.
    """
    woken(topic, partition)
    from kvflow.streams.doorbell import ring

    ring(topic, partition)


def woken(topic: str, partition: int | None = None) -> None:
    """Mark activity on this process's adaptive consumers assigned ``topic``
    (``partition``, or None for any) and cut the fetch of those parked in a
    long one. What a doorbell ring runs (:mod:`kvflow.streams.doorbell`)."""
    now = time.monotonic()
    for consumer, policy in list(_local.items()):
        # A consumer polling fast is not cut, but the ring still counts as activity: the record
        # may land just after its fetch in flight (a ring can precede the write it announces),
        # and a rung consumer whose window ended then would park past it.
        try:
            assigned = consumer.assignment()
        except Exception:  # noqa: BLE001 - consumer stopping or being reassigned
            continue
        if any(tp.topic == topic and (partition is None or tp.partition == partition) for tp in assigned) \
                and policy.wake(now) and policy.cut is not None:
            policy.cut()


_local: "weakref.WeakKeyDictionary[Any, FetchWaitPolicy]" = weakref.WeakKeyDictionary()


def wake(consumer: Any) -> None:
    """:func:`wake_policy` for ``consumer``'s policy, if it has one (no-op otherwise)."""
    fetcher = getattr(consumer, "_fetcher", None)
    wake_policy(getattr(fetcher, "_kvflow_wait", None))
