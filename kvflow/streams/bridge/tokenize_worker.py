"""The child process of a :class:`~kvflow.streams.bridge.tokenize_pool.TokenizePool`.

Run as ``python -m kvflow.streams.bridge.tokenize_worker``. It reads jobs
from stdin and writes one answer per job to stdout, in order, each a frame:
a 4-byte big-endian length, then a pickle (both ends are kvflow's own code
in one deployment, so pickle is trusted here). A job is ``(job_id, spec,
kind, payload)`` with ``kind`` one of ``"warm"`` (load ``spec``),
``"chat"`` (payload: turns as ``{"role", "content"}`` dicts) or
``"prompt"`` (payload: text). An answer is ``(job_id, status, value,
cache_chars, encoded_chars)``: ``status`` ``"ok"`` with the ids packed as
``array('I')`` bytes, ``"template_error"`` with the template's message, or
``"error"`` with a description. It exits at the end of stdin.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
from array import array
from typing import Any, BinaryIO

__all__ = ["HEADER", "read_frame", "frame", "answer", "chunk_counts", "template_errors", "main"]

HEADER = struct.Struct(">I")
"""Frame header: the length of the pickle that follows, bytes."""


def frame(obj: Any) -> bytes:
    """``obj`` as one frame (header and pickle)."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's object from a blocking ``stream``; None at its end."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    return pickle.loads(stream.read(size))


def chunk_counts(tok: Any) -> tuple[int, int] | None:
    """(characters taken from ``tok``'s chunk cache, characters encoded), or
    None for a tokenizer without one (:mod:`kvflow.models.chunked_encode`)."""
    cache = getattr(tok, "chunk_cache", None)
    return (cache.hit_chars, cache.miss_chars) if cache is not None else None


def template_errors() -> tuple[type[BaseException], ...]:
    """The exception types of a chat template rejecting a conversation
    (``jinja2.TemplateError``; none without jinja2), for an ``except`` clause."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # no chat templates without jinja2
        return ()
    return (TemplateError,)


def answer(job: tuple[int, str, str, Any]) -> tuple[int, str, Any, int, int]:
    """The answer to one job (see the module docstring); never raises."""
    from kvflow.models.tokenizer import load_tokenizer

    job_id, spec, kind, payload = job
    try:
        tok = load_tokenizer(spec)
        if kind == "warm":
            tok.warm()
            return job_id, "ok", b"", 0, 0
        hit, miss = chunk_counts(tok) or (0, 0)
        ids = tok.encode_chat(payload) if kind == "chat" else tok.encode_prompt(payload)
        hit2, miss2 = chunk_counts(tok) or (0, 0)
        return job_id, "ok", array("I", ids).tobytes(), hit2 - hit, miss2 - miss
    except template_errors() as exc:
        return job_id, "template_error", str(exc), 0, 0
    except Exception as exc:  # noqa: BLE001 - every failure is an answer; the bridge decides
        return job_id, "error", f"{type(exc).__name__}: {exc}", 0, 0


def main() -> None:
    """Serve jobs from stdin until it ends."""
    # The child encodes one job at a time; the tokenizers library's own
    # thread pool would only compete with the deployment for the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group; the bridge stops its children by
    # ending their stdin (and they end with it if the bridge dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the frames
    jobs = sys.stdin.buffer
    while (job := read_frame(jobs)) is not None:
        out.write(frame(answer(job)))
        out.flush()


if __name__ == "__main__":
    main()
