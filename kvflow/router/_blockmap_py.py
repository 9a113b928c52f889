"""Pure-Python twin of the compiled :mod:`kvflow.router._blockmap`.

Same interface and semantics as its ``BlockMap`` (block hash -> bitmask of
up to 64 worker slots holding it); :mod:`kvflow.router.index` falls back to
it where the C module was not built. It is several times slower on events
and lookups, and is tested against the compiled one on the same operations.

Like the compiled map, every method taking hashes accepts a sequence of ints
or a C-contiguous buffer of native unsigned 64-bit integers (a memoryview
cast to ``'Q'``, ``array('Q')``, a numpy ``uint64`` array).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_U64 = 1 << 64
_NATIVE_U64 = {"Q", "=Q", "@Q", "L", "=L", "@L", ("<Q" if sys.byteorder == "little" else ">Q"),
               ("<L" if sys.byteorder == "little" else ">L")}


def _ints(hashes: Sequence[int]) -> Sequence[int]:
    """``hashes`` as a sequence of ints: a buffer of native u64 is unpacked, anything else kept."""
    if isinstance(hashes, (list, tuple)):
        return hashes
    try:
        view = memoryview(hashes)  # type: ignore[arg-type]
    except TypeError:
        return hashes
    if view.ndim == 1 and view.itemsize == 8 and view.format in _NATIVE_U64 and view.c_contiguous:
        return view.cast("B").cast("Q").tolist()
    return hashes


def _key(h: object) -> int:
    if not isinstance(h, int) or not 0 <= h < _U64:
        raise ValueError(f"block hash must be an int in [0, 2**64), got {h!r}")
    return h


def _checked(bit: int, hashes: Sequence[int]) -> int:
    """``bit``'s mask, after checking the slot and every hash (so a change is all or nothing)."""
    b = _bit(bit)
    for h in hashes:
        _key(h)
    return b


def _bit(bit: int) -> int:
    if not 0 <= bit <= 63:
        raise ValueError(f"worker bit must be in [0, 63], got {bit}")
    return 1 << bit


class BlockMap:
    """Block hash -> bitmask of up to 64 worker slots holding it.

    ``len()`` is the number of distinct hashes held by any slot. Every method
    raises ValueError for a slot outside 0..63 or a hash outside [0, 2**64).
    """

    __slots__ = ("_counts", "_masks")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._counts = [0] * 64

    def store(self, bit: int, hashes: Sequence[int]) -> int:
        """Mark slot ``bit`` as holding ``hashes`` (idempotent); returns how many were new.

        Raises ValueError (changing nothing) for a bad slot or hash.
        """
        hashes = _ints(hashes)
        b = _checked(bit, hashes)
        masks = self._masks
        added = 0
        for h in hashes:
            m = masks.get(h, 0)
            if not m & b:
                masks[h] = m | b
                added += 1
        self._counts[bit] += added
        return added

    def remove(self, bit: int, hashes: Sequence[int]) -> int:
        """Mark slot ``bit`` as no longer holding ``hashes`` (unknown ones ignored); returns how many.

        Raises ValueError (changing nothing) for a bad slot or hash.
        """
        hashes = _ints(hashes)
        b = _checked(bit, hashes)
        masks = self._masks
        removed = 0
        for h in hashes:
            m = masks.get(h, 0)
            if m & b:
                removed += 1
                if m == b:
                    del masks[h]
                else:
                    masks[h] = m & ~b
        self._counts[bit] -= removed
        return removed

    def clear(self, bit: int) -> int:
        """Drop every hash of slot ``bit``; returns how many."""
        b = _bit(bit)
        had = self._counts[bit]
        if had:
            self._masks = {h: m & ~b for h, m in self._masks.items() if m & ~b}
            self._counts[bit] = 0
        return had

    def get(self, h: int) -> int:
        """The mask of slots holding ``h`` (0 if none)."""
        return self._masks.get(_key(h), 0)

    def count(self, bit: int) -> int:
        """Hashes held by slot ``bit``."""
        _bit(bit)
        return self._counts[bit]

    def hashes(self, bit: int) -> list[int]:
        """Hashes held by slot ``bit``, unordered."""
        b = _bit(bit)
        return [h for h, m in self._masks.items() if m & b]

    def match(self, hashes: Sequence[int], names: list, out: dict) -> None:
        """For every slot ``b`` holding a leading run of ``hashes``, set ``out[names[b]]`` to its length.

        Slots beyond ``len(names)`` or named None are skipped. The walk stops
        at the first block no still-matching slot holds.
        """
        hashes = _ints(hashes)
        masks = self._masks
        running = -1
        n = len(hashes)
        depth = 0
        for depth, h in enumerate(hashes):
            now = masks.get(_key(h), 0) & running
            if now != running:
                if depth:
                    _set(out, names, running & ~now, depth)
                running = now
                if not running:
                    return
        if n and running:
            _set(out, names, running, n)

    def __len__(self) -> int:
        return len(self._masks)


def _set(out: dict, names: list, bits: int, depth: int) -> None:
    while bits:
        low = bits & -bits
        b = low.bit_length() - 1
        bits ^= low
        if b < len(names) and names[b] is not None:
            out[names[b]] = depth
