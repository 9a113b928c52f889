"""The router's held-request queue in ``priority`` order: class, tenant fair share, deadline.

:class:`FairRequestQueue` releases (:meth:`~FairRequestQueue.pop`):

1. from the highest priority class held (strict priority: a request of a
   lower class waits while any of a higher class is held);
2. within that class, from the tenant with the least service so far, so a
   tenant sending ten times the requests of another cannot starve it. This
   is start-time fair queuing (Goyal, Vin and Cheng, "Start-time Fair
   Queueing", SIGCOMM 1996) with one unit of service per released request
   and equal weights: each (class, tenant) has a virtual time, raised by 1
   at each release; a tenant that had nothing held starts at the class's
   virtual clock (the virtual time of the last release), so idling earns no
   credit. Ties go to the smaller tenant id;
3. within that tenant, earliest deadline first (EDF; a request without a
   deadline comes after every one with), ties in arrival order.

When the queue is full, :meth:`~FairRequestQueue.displace` sheds the lowest
class first: the victim is a request of the lowest class held, taken from
the tenant holding the most of that class, its latest deadline (latest
arrival on ties). A new request takes the victim's place when its class is
higher, or when it is of the same class and its tenant holds at least two
fewer requests of that class than the victim's tenant (so the heavier
tenant absorbs the shedding); otherwise the new request is the one shed.

Pure data structure: no I/O, no clock (deadlines and times are passed in).
Operations cost O(log n) within a tenant plus O(classes + tenants of a class).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvflow.router.shedding import QueueFull

__all__ = ["FairRequestQueue"]

T = TypeVar("T")

_NO_DEADLINE = math.inf

# One held request: (deadline key, arrival seq, deadline_ms or None, item).
_Entry = tuple[float, int, Any, Any]


@dataclass
class FairRequestQueue(Generic[T]):
    """A bounded queue served by priority class, tenant fair share, then EDF (module docstring).

    Higher ``priority`` is served first (as :class:`~kvflow.schemas.InferenceRequest`
    documents it). ``tenant`` is any string (the bridge uses a digest of the
    API key; ``""`` for requests without one).

    Args:
        capacity: most items held (>= 1).

    Raises:
        ValueError: ``capacity < 1``.
    """

    capacity: int
    _classes: dict[int, dict[str, list[_Entry]]] = field(init=False, default_factory=dict)
    _vtime: dict[tuple[int, str], float] = field(init=False, default_factory=dict)
    _clock: dict[int, float] = field(init=False, default_factory=dict)
    _len: int = field(init=False, default=0)
    _seq: Any = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")

    # ---- adding -------------------------------------------------------------------

    def push(self, item: T, isl: int = 0, deadline_ms: int | None = None, *, priority: int = 0,
             tenant: str = "") -> None:
        """Hold ``item`` of class ``priority`` for ``tenant`` (``isl`` is ignored: the order
        does not look at prompt length; ``deadline_ms`` absolute ms, None = none).

        Raises:
            QueueFull: ``capacity`` items are already held.
        """
        if self._len >= self.capacity:
            raise QueueFull(f"request queue full ({self.capacity})")
        self._add(item, deadline_ms, priority, tenant)

    def displace(self, item: T, isl: int = 0, deadline_ms: int | None = None, *, priority: int = 0,
                 tenant: str = "") -> T | None:
        """Hold ``item``, shedding the lowest class first when full (module docstring).

        Returns:
            The held item pushed out to make room (to be shed), or None when
            there was room.

        Raises:
            QueueFull: full, and ``item`` ranks no higher than the victim: shed it instead.
        """
        if self._len < self.capacity:
            self._add(item, deadline_ms, priority, tenant)
            return None
        low = min(self._classes)
        tenants = self._classes[low]
        victim_tenant = max(tenants, key=lambda t: (len(tenants[t]), self._vtime[(low, t)], t))
        if not (priority > low or (priority == low and len(tenants.get(tenant, ())) + 2
                                   <= len(tenants[victim_tenant]))):
            raise QueueFull(f"request queue full ({self.capacity}) of requests that rank no lower")
        heap = tenants[victim_tenant]
        worst = max(range(len(heap)), key=lambda i: (heap[i][0], heap[i][1]))
        victim = heap[worst][3]
        heap[worst] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        self._len -= 1
        self._forget_if_empty(low, victim_tenant)
        self._add(item, deadline_ms, priority, tenant)
        return victim

    def _add(self, item: T, deadline_ms: int | None, priority: int, tenant: str) -> None:
        tenants = self._classes.setdefault(priority, {})
        heap = tenants.get(tenant)
        if heap is None:  # the tenant becomes active in this class: no credit for idling
            heap = tenants[tenant] = []
            key = (priority, tenant)
            self._vtime[key] = max(self._vtime.get(key, 0.0), self._clock.get(priority, 0.0))
        dl = _NO_DEADLINE if deadline_ms is None else float(deadline_ms)
        heapq.heappush(heap, (dl, next(self._seq), deadline_ms, item))
        self._len += 1

    # ---- taking -------------------------------------------------------------------

    def _next(self) -> tuple[int, str]:
        """(class, tenant) of the next release."""
        if not self._len:
            raise IndexError("the request queue is empty")
        top = max(self._classes)
        vtime = self._vtime
        tenant = min(self._classes[top], key=lambda t: (vtime[(top, t)], t))
        return top, tenant

    def peek(self) -> T:
        """The next item, left in place.

        Raises:
            IndexError: the queue is empty.
        """
        cls, tenant = self._next()
        return self._classes[cls][tenant][0][3]

    def peek_priority(self) -> int:
        """The class of the next item.

        Raises:
            IndexError: the queue is empty.
        """
        if not self._len:
            raise IndexError("the request queue is empty")
        return max(self._classes)

    def pop(self) -> T:
        """Remove and return the next item; its tenant's virtual time advances by one.

        Raises:
            IndexError: the queue is empty.
        """
        cls, tenant = self._next()
        key = (cls, tenant)
        self._clock[cls] = self._vtime[key]
        self._vtime[key] += 1.0
        item = heapq.heappop(self._classes[cls][tenant])[3]
        self._len -= 1
        self._forget_if_empty(cls, tenant)
        return item

    def _forget_if_empty(self, cls: int, tenant: str) -> None:
        tenants = self._classes[cls]
        if tenants[tenant]:
            return
        del tenants[tenant]
        key = (cls, tenant)
        if self._vtime[key] <= self._clock.get(cls, 0.0):
            del self._vtime[key]  # would restart at the clock anyway: keeps the map to active tenants
        if not tenants:
            del self._classes[cls]

    def _take(self, matches: Callable[[_Entry], bool]) -> list[T]:
        """Remove every entry ``matches`` selects; returned by class (high first), deadline, arrival."""
        gone: list[tuple[int, _Entry]] = []
        for cls in list(self._classes):
            tenants = self._classes[cls]
            for tenant in list(tenants):
                heap = tenants[tenant]
                keep = [e for e in heap if not matches(e)]
                if len(keep) == len(heap):
                    continue
                gone.extend((cls, e) for e in heap if matches(e))
                heapq.heapify(keep)
                tenants[tenant] = keep
                self._forget_if_empty(cls, tenant)
        self._len -= len(gone)
        gone.sort(key=lambda ce: (-ce[0], ce[1][0], ce[1][1]))
        return [e[3] for _, e in gone]

    def pop_expired(self, now_ms: int) -> list[T]:
        """Remove and return items whose deadline is <= ``now_ms``."""
        return self._take(lambda e: e[0] <= now_ms)

    def remove(self, matches: Callable[[T], bool]) -> list[T]:
        """Remove and return the items for which ``matches(item)`` is true (O(len))."""
        return self._take(lambda e: matches(e[3]))

    def held_by_tenant(self) -> dict[str, int]:
        """Items held per tenant, all classes together (for metrics and tests)."""
        out: dict[str, int] = {}
        for tenants in self._classes.values():
            for tenant, heap in tenants.items():
                out[tenant] = out.get(tenant, 0) + len(heap)
        return out

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0
