"""Stop-string handling on streamed text, engine-agnostic."""

from __future__ import annotations

__all__ = ["StopChecker"]


class StopChecker:
    """Finds the first stop string in streamed text and holds back text that
    could still become one.

    ``feed(text)`` returns ``(safe_text, stopped)``: the text that can be sent
    now, and whether a stop string was found (the stop string and everything
    after it are dropped, as the OpenAI API does). ``flush()`` returns the
    held-back tail once the stream ends without a stop.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed ``text``; see class doc."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.stopped = "", True
            return buf[:cut], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Text held back at the end of a stream that never hit a stop."""
        out, self.held = self.held, ""
        return "" if self.stopped else out
