"""KV cache tiers below engine memory: G2 (host memory) and G3 (local disk).

G1 is the engine's own prefix cache (:class:`~kvflow.workers.kv.blocks.BlockPool`
in the mocker, the hf engine's block LRU). :class:`TieredStore` holds the
blocks G1 lets go of:

* **Offload** (G1 -> G2): a block evicted from G1 is copied into G2 (host
  memory). A block G2 already holds is only marked recently used. G2 is an
  LRU bounded by ``host_bytes``.
* **Demote** (G2 -> G3): a block pushed out of G2 goes to G3 (disk) only if
  it was *reused* often enough (below), else it is dropped. G3 is an LRU
  bounded by ``disk_bytes``; its files are written atomically and
  checksummed by the :mod:`~kvflow.workers.kv.disk` backend. With no host
  budget, offloaded blocks meet the same filter on their way straight to G3.
* **Onboard** (G2/G3 -> G1): on a prompt whose prefix continues past G1's
  hit in G2 or G3, the engine loads those blocks into G1 instead of
  recomputing them (:meth:`TieredStore.onboard`). Lower tiers keep their
  copy (inclusive caching), so a block evicted from G1 again costs no copy.
  A G3 block whose file is missing or fails its checksum ends the run: it
  and everything after it are recomputed, and it is dropped from G3.

Reuse frequency (kvflow's choice): a block seen for the first
time has frequency 1; every reuse (a prefix hit in any tier, reported with
:meth:`TieredStore.record_hits` or counted by :meth:`TieredStore.onboard`)
doubles it; it halves every ``half_life_s`` seconds without use
(``f(t) = f0 · 2^-(t - t0)/half_life_s``). A block goes to disk when its
frequency is at least ``disk_min_frequency``, 3 by default: one reuse (at
most 2) never qualifies, two reuses (4) do while they are less than
``log2(4/3)`` ≈ 0.41 half-lives old, and more reuses qualify for longer. So
one-off prompts never cost disk writes.

Capacities are never exceeded: before a block enters a tier, that tier
evicts least-recently-used blocks until the new one fits; a block larger
than a whole tier skips it.

Every change is recorded as a KV event with its tier
(``BlockStored``/``BlockRemoved`` with ``tier=host`` or ``disk``), which the
engine publishes with its device events; between two
:meth:`TieredStore.take_events` only the net change is reported (a block
that came and went is reported removed), and consecutive blocks of one
chain share an event. Counters are in :class:`TierStats`.

Pure logic: no clock (callers pass ``now_s``), no I/O except through the disk
backend; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.schemas import BlockRemoved, BlockStored, KvEvent, KvTier, KvTierMetrics
from kvflow.workers.kv.disk import DiskBackend, ModelDisk

__all__ = ["Onboarded", "OffloadedBlock", "TierConfig", "TierStats", "TieredStore", "tier_metrics"]

_GB = 1 << 30


@dataclass(frozen=True)
class TierConfig:
    """Budgets and the disk filter of a :class:`TieredStore`.

    Attributes:
        host_bytes: G2 budget in bytes (0: no host tier). Defaults to ``0``.
        disk_bytes: G3 budget in bytes (0: no disk tier). Defaults to ``0``.
        half_life_s: seconds for an unused block's reuse frequency to halve.
            Defaults to ``600`` (kvflow's choice: users of the Mooncake
            conversation trace come back to a conversation after minutes).
        disk_min_frequency: frequency a block needs to be written to disk.
            Defaults to ``3.0`` (two recent reuses; see the module docstring).
        max_tracked: most blocks whose frequency is remembered (oldest
            forgotten first). Defaults to ``1 << 20``.

    Raises:
        ValueError: a negative budget, ``half_life_s <= 0``, ``max_tracked < 1``.
    """

    host_bytes: int = 0
    disk_bytes: int = 0
    half_life_s: float = 600.0
    disk_min_frequency: float = 3.0
    max_tracked: int = 1 << 20

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError(f"tier budgets must be >= 0, got host {self.host_bytes}, disk {self.disk_bytes}")
        if not self.half_life_s > 0 or self.max_tracked < 1:
            raise ValueError("half_life_s must be > 0 and max_tracked >= 1")

    @classmethod
    def from_gb(cls, host_gb: float = 0.0, disk_gb: float = 0.0, **kw: Any) -> TierConfig:
        """Budgets given in GiB (``--kv-host-gb``, ``--kv-disk-gb``)."""
        return cls(host_bytes=int(host_gb * _GB), disk_bytes=int(disk_gb * _GB), **kw)

    @property
    def enabled(self) -> bool:
        """Whether any tier below G1 has a budget."""
        return self.host_bytes > 0 or self.disk_bytes > 0


@dataclass
class TierStats:
    """Cumulative counters of a :class:`TieredStore` (blocks and bytes; times in ms).

    ``offloaded_*``: G1 -> G2 copies; ``demoted_*``: G2 -> G3 writes;
    ``onboarded_host_*`` / ``onboarded_disk_*``: loads into G1 from G2 / G3;
    ``disk_corrupt_blocks``: G3 reads that failed (missing file or bad
    checksum); ``disk_write_errors``: failed G3 writes. ``lookup_blocks`` /
    ``device_hit_blocks`` are filled by the engine (prompt blocks it looked
    up, and those G1 held) so that per-tier hit rates share one denominator;
    ``onboard_ms`` is the engine's measured (hf) or modelled (mocker) time.
    """

    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    demoted_blocks: int = 0
    demoted_bytes: int = 0
    onboarded_host_blocks: int = 0
    onboarded_host_bytes: int = 0
    onboarded_disk_blocks: int = 0
    onboarded_disk_bytes: int = 0
    disk_corrupt_blocks: int = 0
    disk_write_errors: int = 0
    lookup_blocks: int = 0
    device_hit_blocks: int = 0
    onboard_ms: float = 0.0

    def hit_rates(self) -> dict[str, float]:
        """Fraction of looked-up prompt blocks served from each tier (0 when nothing was looked up)."""
        n = self.lookup_blocks
        if not n:
            return {"device": 0.0, "host": 0.0, "disk": 0.0}
        return {"device": self.device_hit_blocks / n, "host": self.onboarded_host_blocks / n,
                "disk": self.onboarded_disk_blocks / n}


@dataclass(slots=True)
class OffloadedBlock:
    """A block G1 let go of: its hash, its parent's hash, its KV (any object; None in a
    simulation) and that KV's size in bytes."""

    block_hash: int
    parent_hash: int | None
    payload: Any
    nbytes: int


@dataclass(slots=True)
class Onboarded:
    """A block loaded from a lower tier: its payload and the tier it came from."""

    payload: Any
    tier: KvTier
    nbytes: int


@dataclass(slots=True)
class _Entry:
    parent: int | None
    payload: Any  # host: the payload; disk: None (the backend holds it)
    nbytes: int


class _Events:
    """Net KV events of the host and disk tiers since the last :meth:`take`.

    Only the net change is kept: a block stored then removed in the same
    window is reported removed (harmless if the consumer never saw it), one
    removed then stored is reported stored. :meth:`take` gives per tier one
    ``BlockRemoved`` and ``BlockStored`` events grouped into parent chains:
    few events per engine step however many blocks moved.
    """

    def __init__(self) -> None:
        self._stored: dict[KvTier, dict[int, int | None]] = {KvTier.host: {}, KvTier.disk: {}}
        self._removed: dict[KvTier, dict[int, None]] = {KvTier.host: {}, KvTier.disk: {}}

    def stored(self, tier: KvTier, block_hash: int, parent: int | None) -> None:
        self._removed[tier].pop(block_hash, None)
        self._stored[tier][block_hash] = parent

    def removed(self, tier: KvTier, block_hash: int) -> None:
        self._stored[tier].pop(block_hash, None)
        self._removed[tier][block_hash] = None

    def take(self) -> list[KvEvent]:
        out: list[KvEvent] = []
        for tier in (KvTier.host, KvTier.disk):
            removed, stored = self._removed[tier], self._stored[tier]
            if removed:
                out.append(BlockRemoved(block_hashes=list(removed), tier=tier))
                removed.clear()
            out += _chains(stored, tier)
            stored.clear()
        return out


def _chains(blocks: dict[int, int | None], tier: KvTier) -> list[KvEvent]:
    """``BlockStored`` events for ``blocks`` (hash -> parent), one per chain run, parents first.

    Runs follow parent links whatever order the blocks came in (an LRU
    evicts a chain leaf first).
    """
    child: dict[int | None, int] = {}
    for h, parent in blocks.items():
        child.setdefault(parent, h)
    out: list[KvEvent] = []
    done: set[int] = set()
    for h, parent in blocks.items():
        if h in done or (parent in blocks and parent not in done):
            continue  # emitted already, or reached from its parent's run
        run = [h]
        done.add(h)
        nxt = child.get(h)
        while nxt is not None and nxt not in done and blocks[nxt] == run[-1]:
            run.append(nxt)
            done.add(nxt)
            nxt = child.get(nxt)
        out.append(BlockStored(parent_block_hash=parent, block_hashes=run, tier=tier))
    for h, parent in blocks.items():  # blocks only reachable through a cycle of parents (not real chains)
        if h not in done:
            done.add(h)
            out.append(BlockStored(parent_block_hash=parent, block_hashes=[h], tier=tier))
    return out


class TieredStore:
    """G2 (host) and G3 (disk) KV tiers under an engine's G1 (see the module docstring).

    Args:
        config: budgets and disk filter.
        disk: the G3 backend; default :class:`~kvflow.workers.kv.disk.ModelDisk`
            (no bytes, for simulated engines). Unused when ``disk_bytes`` is 0.
    """

    def __init__(self, config: TierConfig, disk: DiskBackend | None = None) -> None:
        self.config = config
        self.disk: DiskBackend = disk if disk is not None else ModelDisk()
        self._host: OrderedDict[int, _Entry] = OrderedDict()
        self._disk: OrderedDict[int, _Entry] = OrderedDict()
        self._host_used = 0
        self._disk_used = 0
        self._freq: OrderedDict[int, tuple[float, float]] = OrderedDict()  # hash -> (frequency, at_s)
        self._events = _Events()
        self.stats = TierStats()

    # ---- queries -------------------------------------------------------

    @property
    def host_used_bytes(self) -> int:
        """Bytes G2 holds (<= ``config.host_bytes``)."""
        return self._host_used

    @property
    def disk_used_bytes(self) -> int:
        """Bytes G3 holds on disk (<= ``config.disk_bytes``)."""
        return self._disk_used

    def num_blocks(self, tier: KvTier | str) -> int:
        """Blocks held in ``tier`` (``host`` or ``disk``; 0 for ``device``)."""
        tier = KvTier(tier)
        return len(self._host) if tier is KvTier.host else len(self._disk) if tier is KvTier.disk else 0

    def held(self, tier: KvTier | str) -> set[int]:
        """Hashes of the blocks held in ``tier`` (``host`` or ``disk``)."""
        tier = KvTier(tier)
        return set(self._host if tier is KvTier.host else self._disk if tier is KvTier.disk else ())

    def tier_of(self, block_hash: int) -> KvTier | None:
        """The fastest tier below G1 holding ``block_hash``, or None."""
        if block_hash in self._host:
            return KvTier.host
        if block_hash in self._disk:
            return KvTier.disk
        return None

    def lookup(self, block_hashes: Sequence[int]) -> list[KvTier]:
        """Tiers of the leading ``block_hashes`` held below G1, in order, up to the first
        miss (no side effects; a G3 file is not checked until :meth:`onboard`)."""
        host, disk = self._host, self._disk
        found: list[KvTier] = []
        for h in block_hashes:
            if h in host:
                found.append(KvTier.host)
            elif h in disk:
                found.append(KvTier.disk)
            else:
                break
        return found

    def frequency(self, block_hash: int, now_s: float) -> float:
        """Reuse frequency of ``block_hash`` at ``now_s`` (0 if never seen or forgotten)."""
        seen = self._freq.get(block_hash)
        if seen is None:
            return 0.0
        f, at = seen
        return f * 0.5 ** (max(now_s - at, 0.0) / self.config.half_life_s)

    # ---- frequency -----------------------------------------------------

    def _bump(self, block_hash: int, now_s: float, factor: float) -> None:
        f = self.frequency(block_hash, now_s)
        freq = self._freq
        freq[block_hash] = (max(f, 1.0) * factor, now_s)
        freq.move_to_end(block_hash)
        if len(freq) > self.config.max_tracked:
            freq.popitem(last=False)

    def record_hits(self, block_hashes: Sequence[int], now_s: float) -> None:
        """Count one reuse of each of ``block_hashes`` (G1 prefix hits): frequency doubles."""
        for h in block_hashes:
            self._bump(h, now_s, 2.0)

    def record_computed(self, block_hashes: Sequence[int], now_s: float) -> None:
        """Note blocks just computed (first sight: frequency 1; known blocks keep theirs)."""
        for h in block_hashes:
            if h not in self._freq:
                self._bump(h, now_s, 1.0)

    # ---- offload ---------------------------------------------------------

    def offload(self, blocks: Sequence[OffloadedBlock], now_s: float) -> None:
        """Take blocks evicted from G1, in eviction order (see the module docstring)."""
        cfg, host = self.config, self._host
        for b in blocks:
            if b.block_hash in host:
                host.move_to_end(b.block_hash)
                continue
            if b.block_hash not in self._freq:
                self._bump(b.block_hash, now_s, 1.0)
            if b.nbytes > cfg.host_bytes:  # no host tier (or too small): straight to the disk filter
                self._demote(b.block_hash, _Entry(b.parent_hash, b.payload, b.nbytes), now_s)
                continue
            while self._host_used + b.nbytes > cfg.host_bytes:
                self._evict_host(now_s)
            host[b.block_hash] = _Entry(b.parent_hash, b.payload, b.nbytes)
            self._host_used += b.nbytes
            self.stats.offloaded_blocks += 1
            self.stats.offloaded_bytes += b.nbytes
            self._events.stored(KvTier.host, b.block_hash, b.parent_hash)

    def _evict_host(self, now_s: float) -> None:
        h, e = self._host.popitem(last=False)
        self._host_used -= e.nbytes
        self._events.removed(KvTier.host, h)
        self._demote(h, e, now_s)

    def _demote(self, block_hash: int, e: _Entry, now_s: float) -> None:
        """Write a block leaving G2 to G3 if its frequency passes the filter."""
        cfg, disk = self.config, self._disk
        if not cfg.disk_bytes or self.frequency(block_hash, now_s) < cfg.disk_min_frequency:
            return
        if block_hash in disk:
            disk.move_to_end(block_hash)
            return
        prepared, size = self.disk.prepare(e.payload, e.nbytes)
        if size > cfg.disk_bytes:
            return
        while self._disk_used + size > cfg.disk_bytes:
            self._drop_disk(next(iter(disk)))
        try:
            self.disk.write(block_hash, prepared)
        except OSError:
            self.stats.disk_write_errors += 1
            return
        disk[block_hash] = _Entry(e.parent, None, size)
        self._disk_used += size
        self.stats.demoted_blocks += 1
        self.stats.demoted_bytes += size
        self._events.stored(KvTier.disk, block_hash, e.parent)

    def _drop_disk(self, block_hash: int) -> None:
        e = self._disk.pop(block_hash)
        self._disk_used -= e.nbytes
        self.disk.delete(block_hash)
        self._events.removed(KvTier.disk, block_hash)

    # ---- onboard ---------------------------------------------------------

    def onboard(self, block_hashes: Sequence[int], now_s: float) -> list[Onboarded]:
        """Load the leading ``block_hashes`` held below G1, for the engine to put into G1.

        Each block found counts one reuse (frequency doubles) and becomes the
        most recently used of its tier. Stops at the first block no tier
        holds, or whose G3 file is missing or corrupt (that block is dropped
        from G3 and counted in ``disk_corrupt_blocks``; the caller recomputes
        it and what follows).

        Returns:
            One :class:`Onboarded` per loaded block, in order.
        """
        host, disk, stats = self._host, self._disk, self.stats
        out: list[Onboarded] = []
        for h in block_hashes:
            e = host.get(h)
            if e is not None:
                host.move_to_end(h)
                out.append(Onboarded(e.payload, KvTier.host, e.nbytes))
                stats.onboarded_host_blocks += 1
                stats.onboarded_host_bytes += e.nbytes
            elif h in disk:
                payload = self.disk.read(h)
                if payload is None:
                    stats.disk_corrupt_blocks += 1
                    self._drop_disk(h)
                    break
                disk.move_to_end(h)
                nbytes = disk[h].nbytes
                out.append(Onboarded(payload, KvTier.disk, nbytes))
                stats.onboarded_disk_blocks += 1
                stats.onboarded_disk_bytes += nbytes
            else:
                break
            self._bump(h, now_s, 2.0)
        return out

    # ---- events ----------------------------------------------------------

    def take_events(self) -> list[KvEvent]:
        """Host and disk KV events since the last call, in order; clears them."""
        return self._events.take()

    def dump(self) -> list[KvEvent]:
        """``BlockStored`` events for every block held now, host then disk (resync)."""
        return [*_chains({h: e.parent for h, e in self._host.items()}, KvTier.host),
                *_chains({h: e.parent for h, e in self._disk.items()}, KvTier.disk)]

    def clear(self) -> None:
        """Drop every block of both tiers (their files too), with ``BlockRemoved`` events."""
        for h in list(self._host):
            self._events.removed(KvTier.host, h)
        self._host.clear()
        self._host_used = 0
        for h in list(self._disk):
            self._drop_disk(h)


def tier_metrics(store: TieredStore) -> KvTierMetrics:
    """``store``'s counters as the metrics record's :class:`~kvflow.schemas.KvTierMetrics`."""
    st = store.stats
    rates = st.hit_rates()
    return KvTierMetrics(
        offloaded_blocks=st.offloaded_blocks, offloaded_bytes=st.offloaded_bytes, demoted_blocks=st.demoted_blocks,
        demoted_bytes=st.demoted_bytes, onboarded_host_blocks=st.onboarded_host_blocks,
        onboarded_host_bytes=st.onboarded_host_bytes, onboarded_disk_blocks=st.onboarded_disk_blocks,
        onboarded_disk_bytes=st.onboarded_disk_bytes, disk_corrupt_blocks=st.disk_corrupt_blocks,
        device_hit_rate=rates["device"], host_hit_rate=rates["host"], disk_hit_rate=rates["disk"],
        onboard_ms=st.onboard_ms, host_used_bytes=store.host_used_bytes, disk_used_bytes=store.disk_used_bytes)
