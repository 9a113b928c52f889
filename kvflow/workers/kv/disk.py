"""Disk tier (G3) backends: where :class:`~kvflow.workers.kv.tiers.TieredStore` keeps blocks on disk.

A backend stores one payload per block hash. The store asks it to
:meth:`~DiskBackend.prepare` a payload first (serialize it and say how many
bytes it will take on disk), evicts until that fits the disk budget, then
:meth:`~DiskBackend.write`\\ s it. :meth:`~DiskBackend.read` returns ``None``
for a block that is missing or fails its checksum: the caller recomputes it,
a damaged block is never served.

:class:`FileDisk` is the real one: one file per block,
``<dir>/<hash as 16 hex digits>.kv``, laid out as::

    b"KVB1" | u64 le payload length | 16-byte XXH3-128 digest of the payload | payload

written to a temporary file in the same directory, flushed, fsync'ed and
renamed over the final name (``os.replace`` is atomic on POSIX), so a
crash leaves either the old file, the new one, or a stray ``*.tmp`` that is
never read. XXH3-128 (xxhash) is a non-cryptographic checksum: it detects
torn writes and bit rot, not tampering.

:class:`ModelDisk` keeps no bytes (the offline simulator's mocker, whose
blocks have no content) and :class:`MemoryDisk` keeps them in a dict
(tests; :meth:`MemoryDisk.corrupt` damages one).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import xxhash

__all__ = ["DiskBackend", "FileDisk", "MemoryDisk", "ModelDisk"]

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sQ16s")  # magic, payload length, XXH3-128 digest


class DiskBackend(Protocol):
    """What :class:`~kvflow.workers.kv.tiers.TieredStore` needs from a disk tier."""

    def prepare(self, payload: Any, nbytes: int) -> tuple[Any, int]:
        """Serialize ``payload`` (``nbytes`` in memory); return what :meth:`write` takes and
        its size on disk in bytes."""

    def write(self, block_hash: int, prepared: Any) -> None:
        """Store a prepared payload under ``block_hash``, atomically. Raises ``OSError``."""

    def read(self, block_hash: int) -> Any | None:
        """The payload of ``block_hash``; ``None`` if it is missing or corrupt."""

    def delete(self, block_hash: int) -> None:
        """Forget ``block_hash`` (no-op if absent)."""


class ModelDisk:
    """A disk tier without contents, for simulated engines: every write succeeds and every
    read of a written block returns ``True``."""

    def __init__(self) -> None:
        self._held: set[int] = set()

    def prepare(self, payload: Any, nbytes: int) -> tuple[Any, int]:
        """``(None, nbytes)``: the block takes its memory size on disk."""
        return None, nbytes

    def write(self, block_hash: int, prepared: Any) -> None:
        """Record ``block_hash`` as written."""
        self._held.add(block_hash)

    def read(self, block_hash: int) -> bool | None:
        """``True`` if ``block_hash`` was written, else ``None``."""
        return True if block_hash in self._held else None

    def delete(self, block_hash: int) -> None:
        """Forget ``block_hash``."""
        self._held.discard(block_hash)


def _frame(data: bytes) -> bytes:
    """``data`` behind the header of the module docstring."""
    return _HEADER.pack(_MAGIC, len(data), xxhash.xxh3_128_digest(data)) + data


def _unframe(blob: bytes) -> bytes | None:
    """The payload of a framed blob; ``None`` when the header, length or checksum do not match."""
    if len(blob) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(blob)
    data = blob[_HEADER.size:]
    if magic != _MAGIC or length != len(data) or xxhash.xxh3_128_digest(data) != digest:
        return None
    return data


class MemoryDisk:
    """A disk tier in a dict, framed and checksummed like :class:`FileDisk` (tests).

    Args:
        encode: payload -> bytes. Defaults to ``bytes``.
        decode: bytes -> payload. Defaults to identity.
    """

    def __init__(self, encode: Callable[[Any], bytes] = bytes, decode: Callable[[bytes], Any] = lambda b: b) -> None:
        self._encode, self._decode = encode, decode
        self.blobs: dict[int, bytearray] = {}

    def prepare(self, payload: Any, nbytes: int) -> tuple[bytes, int]:
        """The framed bytes and their length."""
        blob = _frame(self._encode(payload))
        return blob, len(blob)

    def write(self, block_hash: int, prepared: bytes) -> None:
        """Keep a copy of ``prepared``."""
        self.blobs[block_hash] = bytearray(prepared)

    def read(self, block_hash: int) -> Any | None:
        """The decoded payload, or ``None`` if absent or its checksum fails."""
        blob = self.blobs.get(block_hash)
        data = None if blob is None else _unframe(bytes(blob))
        return None if data is None else self._decode(data)

    def delete(self, block_hash: int) -> None:
        """Drop ``block_hash``."""
        self.blobs.pop(block_hash, None)

    def corrupt(self, block_hash: int) -> None:
        """Flip one payload bit of ``block_hash`` (tests)."""
        self.blobs[block_hash][-1] ^= 1


class FileDisk:
    """One checksummed file per block under ``directory`` (see the module docstring).

    Args:
        directory: created if missing. Files of an earlier run (``*.kv``,
            ``*.tmp``) are deleted: nothing indexes them any more.
        encode: payload -> bytes (the hf engine: safetensors). Defaults to ``bytes``.
        decode: bytes -> payload. Defaults to identity.

    Raises:
        OSError: ``directory`` cannot be created or listed.
    """

    def __init__(self, directory: str | os.PathLike, encode: Callable[[Any], bytes] = bytes,
                 decode: Callable[[bytes], Any] = lambda b: b) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob("*.kv"), *self.directory.glob("*.tmp")]:
            stale.unlink(missing_ok=True)
        self._encode, self._decode = encode, decode

    def path(self, block_hash: int) -> Path:
        """The file of ``block_hash``."""
        return self.directory / f"{block_hash:016x}.kv"

    def prepare(self, payload: Any, nbytes: int) -> tuple[bytes, int]:
        """The framed bytes and their length (the file's size)."""
        blob = _frame(self._encode(payload))
        return blob, len(blob)

    def write(self, block_hash: int, prepared: bytes) -> None:
        """Write the file atomically: temporary file, fsync, rename.

        Raises:
            OSError: the write failed (the temporary file is removed).
        """
        final = self.path(block_hash)
        tmp = final.with_name(f"{final.stem}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(prepared)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, block_hash: int) -> Any | None:
        """The decoded payload; ``None`` if the file is missing, unreadable, or fails its
        checksum (or ``decode`` rejects it)."""
        try:
            data = _unframe(self.path(block_hash).read_bytes())
        except OSError:
            return None
        if data is None:
            return None
        try:
            return self._decode(data)
        except Exception:  # a payload that passed the checksum but is not ours: treat as corrupt
            return None

    def delete(self, block_hash: int) -> None:
        """Remove the file (no-op if absent)."""
        self.path(block_hash).unlink(missing_ok=True)
