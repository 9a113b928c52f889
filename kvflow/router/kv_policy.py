"""KV-aware routing: pick the worker with the lowest estimated cost.

Two registered policies share one cost function:

* ``kv`` reads cache contents from the event-fed
  :class:`~kvflow.router.index.KvIndex` in ``table.kv_index``;
* ``approx`` has no KV events: it predicts cache contents from its own
  decisions (:class:`ApproxKvIndex`, kept in ``table.kv_index``): after
  routing, the prompt's blocks are assumed cached on the chosen worker for
  ``approx_ttl_ms``, and at most ``kv_total_blocks`` of them per worker.

Cost of sending a request to worker ``w`` (every term in KV blocks, or
block-equivalents)::

    prefill_blocks   = ceil(isl / block_size)                      new work if nothing were cached
    adjusted_prefill = max(prefill_blocks − overlap_credit·device_overlap
                           − host_weight·host_overlap − disk_weight·disk_overlap, 0)
    queued_prefill   = active_prefill_tokens / block_size          prompt work already waiting on w
                       + routed_prefill_tokens / block_size        requests on w its heartbeat leaves out
                         (or routed_since_heartbeat · prefill_blocks when their sizes are unknown)
    decode_requests  = active_requests + routed_since_heartbeat    running (decoding) requests on w
    stall_exposure   = Σ 1 / (max_tokens_r − 1) over the requests r that w holds
    cost = prefill_load_scale · (adjusted_prefill + queue_weight · queued_prefill)
           + decode_weight · decode_requests
           + stall_weight · adjusted_prefill · stall_exposure

Why these terms:

* ``adjusted_prefill`` + ``queued_prefill`` estimate the time to first token
  on ``w``: its own uncached prompt plus the prompt work queued ahead of it
  (first-come first-served admission). ``queue_weight`` < 1 discounts the
  queue: prompts queued on a worker are often being routed there *because*
  their prefixes live there, and sending a request elsewhere to dodge that
  queue recomputes its whole cached prefix — extra prefill for the cluster
  and a duplicate copy of the prefix in KV memory.
* Decode load is the number of running requests, each worth
  ``decode_weight`` prefill blocks: every request sharing a worker's steps
  slows every decode step and is slowed by every prefill chunk placed there.
  The worker's KV blocks in use are deliberately *not* in the cost: they
  mostly measure context length, and on the replay below adding them (at
  1/16 per block) raised TPOT p99 from 20.5 to 28.6 ms and lowered the hit
  rate. KV memory pressure is handled by load shedding instead
  (:mod:`kvflow.router.shedding`, ``kv_threshold``).
* The stall term charges what the request's prefill does to the requests
  already on ``w``: its chunks share their steps, and a step that prefills
  thousands of tokens takes ~25× a decode step (the mocker's timing model:
  ~175 ms for an 8,192-token chunk against ~6.5 ms), so each of them waits.
  A stall of ``t`` ms between two tokens of a request that decodes ``osl``
  tokens adds ``t / (osl − 1)`` to its mean inter-token latency (the
  per-request ITL that AIPerf reports and SLAs bound), so the damage is the
  prefill's duration (∝ ``adjusted_prefill``) times ``stall_exposure``
  (:func:`kvflow.router.inflight.stall_exposure`, with each request's
  ``max_tokens`` standing in for its unknown ``osl``). ``stall_weight``
  says how many blocks of the new request's own prefill (its TTFT) one
  block of that summed ITL damage is worth; 20 is kvflow's choice, in the
  range of usual TTFT-to-ITL SLA ratios (500 ms to 25–50 ms). The term
  protects short answers most: a worker holding requests that decode 94
  tokens each is charged four times what one holding 377-token answers
  is. It replaced a flat charge (``stall_weight · adjusted_prefill`` on any
  worker running requests, off by default), which fixed the long-prompt
  trace's tail but doubled the Mooncake trace's, because it did not tell a
  long answer from a short one. Offline replays (``docs/benchmarks.md``,
  "Routing and the long-prompt ITL tail"), per-request ITL p99 without →
  with the term at 20: synthetic long prompts (300 requests, 4 workers)
  18.1 → 13.2 ms; Mooncake, first 300 requests (4 workers) 36.7 → 22.6 ms;
  all 7,851 Mooncake requests (8 workers) 19.0 → 13.3 ms with the SLA
  attainment and prefix hit rate within noise; Azure conversations 48.4 →
  44.9 ms.
* Requests a worker took or was sent after its last heartbeat are not yet
  in the heartbeat's figures; the router counts them itself, with the
  prompt tokens each is expected to compute, and drops requests that ended
  (:mod:`kvflow.router.inflight`), which keeps a burst between heartbeats
  from piling onto one worker and lets a worker that just finished look
  idle at once. For a worker that publishes no inflight records, each
  request routed since its heartbeat is assumed as large as the current one.

Defaults (``queue_weight`` 0.5, ``decode_weight`` 8) are kvflow's choice,
tuned with the offline simulator (:mod:`kvflow.replay.simulator`) on two
traces: the Mooncake conversation trace (first 40 minutes, 8 mocker workers
of 16,384 blocks of 64 tokens; ``python bench/routing_quality.py``), where
prefix reuse decides, and the Azure 2023 conversation trace (4 and 5 workers,
mocker 4x slower, SLA TTFT 500 ms and ITL 50 ms), which has no shared
prefixes, so only the load terms act. On Mooncake ``decode_weight`` 16
reached a slightly higher hit rate (0.251 vs 0.247) but a worse TPOT p99
(20.5 vs 19.0 ms); on Azure it left more requests outside the SLA than round
robin (98.57% vs 98.67% within it on 4 workers), as every running request
then weighs as much as 2,048 prompt tokens queued ahead, so arrivals pile
onto a worker busy with long prompts. With 8: 98.88% on 4 workers, 99.58% on 5
(round robin 99.55%); these figures were taken without the stall term. The
cost of Dynamo's KV router (its router design docs: prefill blocks after
overlap plus the worker's active KV blocks, both weight 1) scored prefix hit
rate 0.204, TTFT p99 1805 ms and TPOT p99 38 ms on that replay; these
defaults reach about 0.25, 1775 ms and 13 ms (1751 ms and 19 ms without the
stall term).

Selection: with ``temperature == 0`` the lowest cost wins, ties to the lowest
worker id; with ``temperature > 0`` costs are min-max normalised to [0, 1]
and a worker is drawn with probability ∝ exp(−normalised / temperature)
using :func:`~kvflow.router.policies.request_rng` (same draw on every
replica). With an empty index (cold start) all overlaps are 0 and the
policy is least-loaded by cost.

Each decision carries every candidate's terms and cost
(:func:`worker_terms`, in ``RoutingDecision.candidates``), which the router
publishes on the routing-decisions topic (``kvflow explain``).

Policies never read the clock: ``approx`` takes the decision time from
``RouteRequest.now_ms`` (epoch or simulated ms; 0 when the field is absent,
which disables expiry but not the capacity bound).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.router.index import KvIndex, OverlapScores
from kvflow.router.policies import Policy, RouteRequest, register_policy, request_rng
from kvflow.router.table import RoutingTable, WorkerView
from kvflow.schemas import CandidateCost, RoutingDecision

__all__ = [
    "DEFAULT_KV_CONFIG",
    "EVENT_POLICIES",
    "ApproxKvIndex",
    "KvPolicyConfig",
    "choose",
    "make_approx_policy",
    "make_kv_policy",
    "worker_costs",
    "worker_terms",
]

EVENT_POLICIES = frozenset({"kv"})
"""Policies that need an event-fed :class:`KvIndex` attached as ``table.kv_index``."""


@dataclass(frozen=True)
class KvPolicyConfig:
    """Weights of the KV-aware cost (see the module docstring).

    Attributes:
        overlap_credit: prefill blocks saved per device-cached block.
            Defaults to ``1.0`` (a cached block is a block not recomputed;
            Dynamo's ``--kv-overlap-score-weight`` default is also 1).
        host_weight: credit per block cached in host memory. Defaults to
            ``0.75`` (kvflow's choice: loading from host costs a fraction of
            recomputing).
        disk_weight: credit per block cached on disk. Defaults to ``0.25``
            (kvflow's choice: with the mocker's tier model, loading a block
            from one NVMe disk and copying it to the device takes about as
            long as recomputing it, so a disk hit mostly saves compute
            for other requests, not time; see ``docs/benchmarks.md``, "KV
            cache tiers").
        prefill_load_scale: weight of prefill blocks (new and queued) against
            decode load. Defaults to ``1.0``.
        queue_weight: weight of the prompt work already queued on a worker,
            relative to the request's own new prefill. Defaults to ``0.5``
            (kvflow's choice, tuned on the Mooncake replay).
        decode_weight: prefill-block equivalents per running request.
            Defaults to ``8.0`` (kvflow's choice, tuned on the Mooncake and
            Azure replays, see the module docstring; 8 blocks of 64 tokens
            = 512 prompt tokens).
        stall_weight: cost per uncached prefill block of the request and
            per unit of the worker's ``stall_exposure`` (the requests there
            whose decodes its prefill would stall, each weighted by
            ``1 / (max_tokens − 1)``). Defaults to ``20.0`` (kvflow's
            choice, tuned with the offline replays of the module docstring;
            0 turns it off).
        temperature: 0 = argmin; > 0 = softmax sampling over normalised
            costs. Defaults to ``0.0`` (Dynamo's ``--router-temperature``
            default).
        approx_ttl_ms: how long ``approx`` assumes a routed prompt stays
            cached. Defaults to ``600_000`` (kvflow's choice: Dynamo's
            120 s TTL without KV events cut the prefix hit rate of the
            Mooncake replay from 0.245 to 0.187, because users come back to a
            conversation after minutes; the per-worker capacity bound models
            eviction better).

    Raises:
        ValueError: a negative weight, TTL or temperature.
    """

    overlap_credit: float = 1.0
    host_weight: float = 0.75
    disk_weight: float = 0.25
    prefill_load_scale: float = 1.0
    queue_weight: float = 0.5
    decode_weight: float = 8.0
    stall_weight: float = 20.0
    temperature: float = 0.0
    approx_ttl_ms: int = 600_000

    @classmethod
    def from_settings(cls, settings: Any) -> "KvPolicyConfig":
        """The weights set by ``settings`` (``kv_overlap_credit``, ``kv_host_weight``,
        ``kv_disk_weight``, ``kv_queue_weight``, ``kv_decode_weight``, ``kv_stall_weight``, ``kv_temperature``
        of :class:`kvflow.settings.Settings`); the other fields keep their defaults.

        Raises:
            ValueError: a negative value.
        """
        return cls(overlap_credit=settings.kv_overlap_credit, host_weight=settings.kv_host_weight,
                   disk_weight=settings.kv_disk_weight, queue_weight=settings.kv_queue_weight,
                   decode_weight=settings.kv_decode_weight, stall_weight=settings.kv_stall_weight,
                   temperature=settings.kv_temperature)

    def __post_init__(self) -> None:
        for name in ("overlap_credit", "host_weight", "disk_weight", "prefill_load_scale", "queue_weight",
                     "decode_weight", "stall_weight", "temperature", "approx_ttl_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


DEFAULT_KV_CONFIG = KvPolicyConfig()
"""The configuration of the registered ``kv`` and ``approx`` policies."""

_NO_SCORES = OverlapScores({})


def worker_terms(req: RouteRequest, candidates: Sequence[WorkerView], scores: OverlapScores,
                 cfg: KvPolicyConfig) -> list[CandidateCost]:
    """The cost of each candidate for ``req`` with its terms (same order; see the module docstring).

    ``scores`` gives each worker's cached prompt prefix by tier. Each
    :class:`~kvflow.schemas.CandidateCost` holds the device overlap
    (blocks), the host and disk overlaps (blocks; None when ``scores`` has
    no host or disk tier), ``prefill_blocks`` (the request's prefill after
    the cache credit, ≥ 0), ``queued_prefill_blocks``, ``decode_requests``,
    ``stall_exposure`` and ``cost`` (KV blocks; lower is better), such that
    ``cost = prefill_load_scale · (prefill_blocks + queue_weight · queued_prefill_blocks)
    + decode_weight · decode_requests + stall_weight · prefill_blocks · stall_exposure``.
    """
    dev, host, disk = scores.device, scores.host, scores.disk
    credit, wh, wd = cfg.overlap_credit, cfg.host_weight, cfg.disk_weight
    scale, wq, wdec, wstall = cfg.prefill_load_scale, cfg.queue_weight, cfg.decode_weight, cfg.stall_weight
    tiers = bool(host or disk)
    terms = []
    for w in candidates:
        bs = w.block_size
        prefill = -(-req.isl // bs)
        wid = w.worker_id
        overlap = dev.get(wid, 0)
        adjusted = prefill - credit * overlap
        if tiers:
            on_host, on_disk = host.get(wid, 0), disk.get(wid, 0)
            adjusted -= wh * on_host + wd * on_disk
        else:
            on_host = on_disk = None
        if adjusted < 0:
            adjusted = 0.0
        routed = w.routed_since_heartbeat
        routed_prefill = w.routed_prefill_tokens
        queued = w.active_prefill_tokens / bs + (routed * prefill if routed_prefill is None else routed_prefill / bs)
        decoding = w.active_requests + routed
        exposure = w.stall_exposure
        cost = scale * (adjusted + wq * queued) + wdec * decoding + wstall * adjusted * exposure
        terms.append(CandidateCost(
            worker_id=wid, overlap_blocks=overlap, host_overlap_blocks=on_host, disk_overlap_blocks=on_disk,
            prefill_blocks=adjusted, queued_prefill_blocks=queued, decode_requests=decoding,
            stall_exposure=exposure, load=w.load, cost=cost))
    return terms


def worker_costs(req: RouteRequest, candidates: Sequence[WorkerView], scores: OverlapScores,
                 cfg: KvPolicyConfig) -> list[float]:
    """Cost of each candidate for ``req`` (same order; lower is better; units: KV blocks).

    ``scores`` gives each worker's cached prompt prefix by tier. The costs
    of :func:`worker_terms`, without their terms.
    """
    return [t.cost for t in worker_terms(req, candidates, scores, cfg)]


def choose(request_id: str, costs: Sequence[float], temperature: float) -> int:
    """Index of the chosen candidate.

    ``temperature == 0``: the first minimum (candidates come sorted by
    worker id, so ties go to the lowest id). Otherwise costs are min-max
    normalised and index ``i`` is drawn with probability ∝
    ``exp(-norm_i / temperature)`` from ``request_rng(request_id)``.
    """
    lo = min(costs)
    if temperature <= 0:
        return costs.index(lo)
    span = max(costs) - lo
    if span <= 0:
        weights = [1.0] * len(costs)
    else:
        weights = [math.exp(-(c - lo) / span / temperature) for c in costs]
    x = request_rng(request_id).random() * sum(weights)
    acc = 0.0
    for i, wt in enumerate(weights):
        acc += wt
        if x < acc:
            return i
    return len(costs) - 1


def _decide(name: str, req: RouteRequest, candidates: list[WorkerView], scores: OverlapScores,
            cfg: KvPolicyConfig) -> RoutingDecision:
    terms = worker_terms(req, candidates, scores, cfg)
    i = choose(req.request_id, [t.cost for t in terms], cfg.temperature)
    chosen = terms[i]
    return RoutingDecision(worker_id=chosen.worker_id, policy=name, overlap_blocks=chosen.overlap_blocks,
                           cost=float(chosen.cost), candidates=tuple(terms))


def make_kv_policy(cfg: KvPolicyConfig = DEFAULT_KV_CONFIG, name: str = "kv") -> Policy:
    """A ``kv`` policy with ``cfg`` (register it with ``register_policy(name)(...)``).

    The policy reads ``table.kv_index`` (a :class:`KvIndex`, or None = cold
    start, all overlaps 0); ``table.kv_config``, when set, replaces ``cfg``
    (how a deployment's settings reach the registered policy).

    Raises (when called):
        TypeError: ``table.kv_index`` is neither None nor a :class:`KvIndex`.
    """

    def kv_policy(req: RouteRequest, candidates: list[WorkerView], table: RoutingTable) -> RoutingDecision:
        index = table.kv_index
        if index is None or not req.block_hashes:
            scores = _NO_SCORES
        elif isinstance(index, KvIndex):
            scores = index.find_matches(req.block_hashes)
        else:
            raise TypeError(f"policy {name!r} needs a KvIndex in table.kv_index, found {type(index).__name__}")
        return _decide(name, req, candidates, scores, table.kv_config or cfg)

    kv_policy.__doc__ = f"KV-aware cost routing over the event-fed index ({cfg})."
    return kv_policy


@dataclass
class ApproxKvIndex:
    """Predicted cache contents from routing decisions (no KV events).

    Each worker's predicted blocks live in an LRU map (block hash → expiry
    ms) beside a :class:`KvIndex` used for matching. A routed prompt's blocks
    are (re)inserted tail first, so when a worker's prediction exceeds its
    capacity the tail of the oldest prompt goes first, as an engine's LRU
    eviction would.

    Attributes:
        block_size: tokens per block.
        ttl_ms: how long a routed block is assumed cached.
    """

    block_size: int
    ttl_ms: int = 600_000
    index: KvIndex = field(init=False)
    _lru: dict[str, OrderedDict[int, int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.index = KvIndex(self.block_size)

    def record(self, worker_id: str, block_hashes: Sequence[int], now_ms: int, capacity_blocks: int | None = None
               ) -> None:
        """Assume ``block_hashes`` cached on ``worker_id`` until ``now_ms + ttl_ms``.

        ``capacity_blocks`` (the worker's KV blocks) bounds what is kept for it.
        """
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        expiry = now_ms + self.ttl_ms
        move = lru.move_to_end
        new = []
        for h in reversed(block_hashes):
            if h in lru:
                move(h)
            else:
                new.append(h)
            lru[h] = expiry
        if new:
            self.index.store_blocks(worker_id, new)
        if capacity_blocks is not None and len(lru) > capacity_blocks:
            drop = [lru.popitem(last=False)[0] for _ in range(len(lru) - capacity_blocks)]
            self.index.remove_blocks(worker_id, drop)

    def expire(self, now_ms: int) -> None:
        """Forget every prediction whose expiry is <= ``now_ms``."""
        for worker_id, lru in self._lru.items():
            drop = []
            for h, expiry in lru.items():  # insertion order = expiry order (constant TTL, time moves forward)
                if expiry > now_ms:
                    break
                drop.append(h)
            if drop:
                for h in drop:
                    del lru[h]
                self.index.remove_blocks(worker_id, drop)

    def find_matches(self, block_hashes: Sequence[int], now_ms: int) -> OverlapScores:
        """Predicted per-worker cached prefix at ``now_ms`` (expires old predictions first)."""
        self.expire(now_ms)
        return self.index.find_matches(block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id``'s predictions."""
        self._lru.pop(worker_id, None)
        self.index.remove_worker(worker_id)

    def workers(self) -> list[str]:
        """Workers with predictions, sorted."""
        return sorted(self._lru)


def make_approx_policy(cfg: KvPolicyConfig = DEFAULT_KV_CONFIG, name: str = "approx") -> Policy:
    """An ``approx`` policy with ``cfg`` (``table.kv_config``, when set, replaces it).

    Keeps its :class:`ApproxKvIndex` in ``table.kv_index`` (created on first
    use with the first candidate's block size); predictions of workers that
    left the table are dropped.

    Raises (when called):
        TypeError: ``table.kv_index`` holds something else (e.g. an event-fed
            :class:`KvIndex`; use ``kv`` then).
    """

    def approx_policy(req: RouteRequest, candidates: list[WorkerView], table: RoutingTable) -> RoutingDecision:
        weights = table.kv_config or cfg
        index = table.kv_index
        if index is None:
            index = table.kv_index = ApproxKvIndex(candidates[0].block_size, weights.approx_ttl_ms)
        elif not isinstance(index, ApproxKvIndex):
            raise TypeError(f"policy {name!r} keeps an ApproxKvIndex in table.kv_index, "
                            f"found {type(index).__name__}")
        for worker_id in index.workers():
            if worker_id not in table.workers:
                index.remove_worker(worker_id)
        now_ms = getattr(req, "now_ms", 0)
        scores = index.find_matches(req.block_hashes, now_ms) if req.block_hashes else _NO_SCORES
        decision = _decide(name, req, candidates, scores, weights)
        if req.block_hashes:
            chosen = table.workers[decision.worker_id]
            index.record(decision.worker_id, req.block_hashes, now_ms, chosen.kv_total_blocks)
        return decision

    approx_policy.__doc__ = f"KV-aware cost routing over predicted cache contents ({cfg})."
    return approx_policy


register_policy("kv")(make_kv_policy(DEFAULT_KV_CONFIG, "kv"))
register_policy("approx")(make_approx_policy(DEFAULT_KV_CONFIG, "approx"))
