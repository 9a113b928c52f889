"""Progress of long commands on stderr: a tqdm bar on a terminal, plain lines otherwise.

When stderr is not a terminal (a log file, CI, a pipe) a redrawn bar is
noise, and no output at all looks like a hang: :func:`progress` then prints
one plain line every ``interval_s`` seconds (``desc: n/total (pct) rate/s,
eta``) and a last one when it closes.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["progress", "PlainProgress", "PLAIN_INTERVAL_S"]

PLAIN_INTERVAL_S = 10.0
"""Seconds between plain progress lines. Defaults to 10."""


class PlainProgress:
    """Periodic plain-text progress lines (the subset of tqdm's API kvflow uses:
    :meth:`update`, :meth:`close`, ``n``, ``total``, use as a context manager)."""

    def __init__(self, total: int | None, desc: str, unit: str, *, interval_s: float = PLAIN_INTERVAL_S,
                 file: IO[str] | None = None, clock=time.monotonic) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.interval_s = interval_s
        self.file = file if file is not None else sys.stderr
        self.clock = clock
        self.started = self.last = clock()
        self.closed = False

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units; print a line if ``interval_s`` has passed since the last."""
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval_s:
            self.last = now
            self._line(now)

    def close(self) -> None:
        """Print the final line (once)."""
        if not self.closed:
            self.closed = True
            self._line(self.clock(), final=True)

    def _line(self, now: float, final: bool = False) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.n / elapsed
        parts = [f"{self.desc}: {self.n:,}" + (f"/{self.total:,}" if self.total else "") + f" {self.unit}"]
        if self.total:
            parts.append(f"({self.n / self.total:.0%})")
        parts.append(f"{rate:,.1f} {self.unit}/s")
        if final:
            parts.append(f"done in {elapsed:,.1f} s")
        elif self.total and rate > 0:
            parts.append(f"eta {(self.total - self.n) / rate:,.0f} s")
        print(" ".join(parts), file=self.file, flush=True)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Off:
    """No progress at all."""

    n = 0
    total = None

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        return None

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress(total: int | None, desc: str, *, unit: str = "req", enabled: bool = True,
             interval_s: float = PLAIN_INTERVAL_S) -> Any:
    """A progress reporter on stderr: tqdm when stderr is a terminal, else
    :class:`PlainProgress` lines every ``interval_s``; nothing when not ``enabled``."""
    if not enabled:
        return _Off()
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, desc=desc, leave=False, mininterval=0.5, file=sys.stderr)
    return PlainProgress(total, desc, unit, interval_s=interval_s)
