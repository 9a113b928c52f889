"""Trace readers: request arrival logs in several public formats → :class:`TraceRequest`.

Formats (detected from the file, or named with ``fmt``):

=============  ======  =====================================================
``mooncake``   .jsonl  ``{"timestamp": ms, "input_length", "output_length",
                       "hash_ids": [...]}`` — one hash id per 512-token block
                       (kvcache-ai/Mooncake FAST'25 traces).
``azure``      .csv    ``TIMESTAMP,ContextTokens,GeneratedTokens`` with
                       datetime stamps (Azure LLM inference traces 2023).
``prompts``    .jsonl  ``{"turns": [...]}`` (MT-Bench) or ``{"prompt": ...}``
                       with real text; arrivals are a Poisson process.
``sharegpt``   .json   ``[{"conversations": [{"from": "human", "value": ...},
                       ...]}]``; arrivals are a Poisson process.
``kvflow``     .jsonl  kvflow's own request log: one
                       :class:`~kvflow.schemas.InferenceRequest` per line.
=============  ======  =====================================================

Order of the options: parse → sort by arrival → ``rate`` re-timing →
``[start_ms, end_ms)`` slice on trace time (then shifted so ``start_ms`` is
0) → ``limit`` → divide arrival times by ``speedup``.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvflow.replay.synth import (
    DEFAULT_VOCAB_SIZE,
    HASH_BLOCK_TOKENS,
    Tokenizer,
    hash_id_tokens,
    unique_tokens,
    word_hash_tokenize,
)
from kvflow.schemas import InferenceRequest

__all__ = [
    "TraceFormatError",
    "TraceRequest",
    "Trace",
    "FORMATS",
    "DEFAULT_OSL",
    "DEFAULT_PROMPT_RATE",
    "detect_format",
    "read_trace",
]

DEFAULT_OSL = 256
"""Output length of text prompts whose format gives none (MT-Bench). Defaults to 256."""

DEFAULT_PROMPT_RATE = 1.0
"""Poisson arrival rate (requests/s) of text-prompt formats without timestamps."""

FORMATS = ("mooncake", "azure", "prompts", "sharegpt", "kvflow")


class TraceFormatError(ValueError):
    """A trace file could not be parsed. The message names the file and line
    (for ``.json`` files, the record index)."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``arrival_ms`` is relative to the trace start (after slicing and speedup).
    ``isl``/``osl`` are input/output lengths in tokens. The prompt's token ids
    come from exactly one source, in this order: explicit ``token_ids``;
    ``hash_ids`` (512-token blocks, synthesized per id); ``text``/``messages``
    (tokenized with the trace's tokenizer when the ids are asked for);
    otherwise unique tokens from ``token_seed`` and ``index``.
    ``index`` is the record's position in the file (0-based), stable under
    slicing.

    Serving classes (Mooncake and kvflow traces, optional keys
    ``priority``, ``tenant``, ``session_id``, ``timeout_ms``,
    ``ttft_target_ms``, ``itl_target_ms``): the request's priority class
    (higher first), who sent it, its session, its deadline in ms after
    arrival (not scaled by ``speedup``; None = none), and its SLA hints (ms).
    """

    request_id: str
    index: int
    arrival_ms: float
    isl: int
    osl: int
    hash_ids: tuple[int, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    token_seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    hash_block_tokens: int = HASH_BLOCK_TOKENS
    category: str | None = None
    priority: int = 0
    tenant: str = ""
    session_id: str | None = None
    timeout_ms: float | None = None
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None

    def prompt_token_ids(self, tokenizer: Tokenizer | None = None) -> list[int]:
        """The prompt's ``isl`` token ids (built on demand, not stored).

        ``tokenizer`` applies only to text requests (default: the word-hash
        stand-in of :func:`~kvflow.replay.synth.word_hash_tokenize`); a text
        prompt is cut or right-padded with unique tokens to ``isl``.
        """
        if self.token_ids is not None:
            return list(self.token_ids)
        if self.hash_ids is not None:
            return hash_id_tokens(self.hash_ids, self.isl, self.vocab_size, self.hash_block_tokens)
        if self.text is not None or self.messages is not None:
            ids = _tokenize(self.prompt_text(), tokenizer, self.vocab_size)
            if len(ids) < self.isl:
                ids += unique_tokens(self.token_seed, self.index, self.isl - len(ids), self.vocab_size)
            return ids[: self.isl]
        return unique_tokens(self.token_seed, self.index, self.isl, self.vocab_size)

    def prompt_text(self) -> str:
        """The prompt as one string (chat messages joined by newlines); ``""`` if none."""
        if self.text is not None:
            return self.text
        if self.messages:
            return "\n".join(m.get("content", "") for m in self.messages)
        return ""


@dataclass
class Trace:
    """A parsed trace: requests sorted by ``arrival_ms``.

    ``hash_block_tokens`` is 512 for Mooncake (hash ids present), else None.
    """

    name: str
    path: str
    format: str
    requests: list[TraceRequest]
    hash_block_tokens: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        """Arrival time of the last request (0 for an empty trace)."""
        return self.requests[-1].arrival_ms if self.requests else 0.0


def _tokenize(text: str, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    return list(tokenizer(text)) if tokenizer is not None else word_hash_tokenize(text, vocab_size)


def _first_record(path: Path) -> tuple[int, str]:
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                return lineno, line
    raise TraceFormatError(path, None, "empty trace file")


def detect_format(path: str | Path) -> str:
    """Name the format of ``path`` (one of :data:`FORMATS`) from its suffix and first record.

    Raises:
        TraceFormatError: unknown suffix, unreadable or unrecognised first record.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "azure"
    if suffix == ".json":
        return "sharegpt"
    if suffix != ".jsonl":
        raise TraceFormatError(path, None, f"unknown trace suffix {suffix!r} (expected .jsonl, .csv or .json)")
    lineno, line = _first_record(path)
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, lineno, f"invalid JSON: {exc.msg}") from None
    if not isinstance(rec, dict):
        raise TraceFormatError(path, lineno, "expected a JSON object per line")
    if "hash_ids" in rec or "input_length" in rec:
        return "mooncake"
    if "request_id" in rec and "reply_to" in rec:
        return "kvflow"
    if "turns" in rec or "prompt" in rec:
        return "prompts"
    raise TraceFormatError(path, lineno, f"unrecognised JSONL record with keys {sorted(rec)[:8]}")


def _jsonl_records(path: Path):
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, lineno, f"invalid JSON: {exc.msg}") from None
            if not isinstance(rec, dict):
                raise TraceFormatError(path, lineno, "expected a JSON object")
            yield lineno, rec


def _int_field(path: Path, lineno: int, rec: dict, key: str, minimum: int) -> int:
    value = rec.get(key)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or value < minimum):
        raise TraceFormatError(path, lineno, f"field {key!r} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _serving_fields(path: Path, lineno: int, rec: dict) -> dict[str, Any]:
    """The optional serving-class keys of a record (:class:`TraceRequest`)."""
    out: dict[str, Any] = {}
    if "priority" in rec:
        out["priority"] = _int_field(path, lineno, rec, "priority", -(2**31))
    for key in ("tenant", "session_id"):
        value = rec.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise TraceFormatError(path, lineno, f"field {key!r} must be a string, got {value!r}")
            out[key] = value
    for key in ("timeout_ms", "ttft_target_ms", "itl_target_ms"):
        value = rec.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise TraceFormatError(path, lineno, f"field {key!r} must be a number > 0, got {value!r}")
            out[key] = float(value)
    return out


def _read_mooncake(path: Path, name: str, vocab_size: int, **_: Any) -> list[TraceRequest]:
    out = []
    for index, (lineno, rec) in enumerate(_jsonl_records(path)):
        ts = rec.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceFormatError(path, lineno, f"field 'timestamp' must be a number of ms >= 0, got {ts!r}")
        isl = _int_field(path, lineno, rec, "input_length", 1)
        osl = _int_field(path, lineno, rec, "output_length", 1)
        hash_ids = rec.get("hash_ids")
        if not isinstance(hash_ids, list) or not hash_ids or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
            raise TraceFormatError(path, lineno, "field 'hash_ids' must be a non-empty list of integers >= 0")
        if isl > len(hash_ids) * HASH_BLOCK_TOKENS:
            raise TraceFormatError(
                path, lineno, f"input_length {isl} exceeds {len(hash_ids)} blocks of {HASH_BLOCK_TOKENS} tokens")
        out.append(TraceRequest(request_id=f"{name}-{index}", index=index, arrival_ms=float(ts), isl=isl, osl=osl,
                                hash_ids=tuple(hash_ids), vocab_size=vocab_size,
                                **_serving_fields(path, lineno, rec)))
    return out


def _read_azure(path: Path, name: str, vocab_size: int, seed: int, **_: Any) -> list[TraceRequest]:
    out = []
    t0: datetime | None = None
    with path.open("r", encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(path, None, "empty trace file")
        cols = [h.strip() for h in header]
        try:
            i_ts, i_ctx, i_gen = cols.index("TIMESTAMP"), cols.index("ContextTokens"), cols.index("GeneratedTokens")
        except ValueError:
            raise TraceFormatError(
                path, 1, f"expected header TIMESTAMP,ContextTokens,GeneratedTokens, got {cols}") from None
        for row in reader:
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            try:
                ts = datetime.fromisoformat(row[i_ts].strip())
                isl, osl = int(row[i_ctx]), int(row[i_gen])
            except (ValueError, IndexError) as exc:
                raise TraceFormatError(path, lineno, f"bad row {row!r}: {exc}") from None
            if isl < 1 or osl < 1:
                raise TraceFormatError(path, lineno, f"token counts must be >= 1, got {isl}, {osl}")
            if t0 is None:
                t0 = ts
            index = len(out)
            out.append(TraceRequest(request_id=f"{name}-{index}", index=index,
                                    arrival_ms=(ts - t0).total_seconds() * 1000.0, isl=isl, osl=osl,
                                    token_seed=seed, vocab_size=vocab_size))
    return out


def _text_request(name: str, index: int, text: str | None, messages: tuple[dict[str, str], ...] | None,
                  osl: int, seed: int, vocab_size: int, tokenizer: Tokenizer | None,
                  category: str | None = None, token_ids: tuple[int, ...] | None = None,
                  arrival_ms: float = 0.0, request_id: str | None = None) -> TraceRequest:
    req = TraceRequest(request_id=request_id or f"{name}-{index}", index=index, arrival_ms=arrival_ms, isl=0,
                       osl=osl, text=text, messages=messages, token_ids=token_ids, token_seed=seed,
                       vocab_size=vocab_size, category=category)
    isl = len(token_ids) if token_ids is not None else len(_tokenize(req.prompt_text(), tokenizer, vocab_size))
    return replace(req, isl=max(isl, 1))


def _read_prompts(path: Path, name: str, vocab_size: int, seed: int, osl: int,
                  tokenizer: Tokenizer | None, **_: Any) -> list[TraceRequest]:
    out = []
    for index, (lineno, rec) in enumerate(_jsonl_records(path)):
        if "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise TraceFormatError(path, lineno, "field 'turns' must be a non-empty list of strings")
            text = turns[0]
        elif isinstance(rec.get("prompt"), str):
            text = rec["prompt"]
        else:
            raise TraceFormatError(path, lineno, "expected a 'turns' list or a 'prompt' string")
        req_osl = _int_field(path, lineno, rec, "max_tokens", 1) if "max_tokens" in rec else osl
        category = rec.get("category") if isinstance(rec.get("category"), str) else None
        out.append(_text_request(name, index, None, ({"role": "user", "content": text},), req_osl, seed,
                                 vocab_size, tokenizer, category))
    return out


def _read_sharegpt(path: Path, name: str, vocab_size: int, seed: int, osl: int,
                   tokenizer: Tokenizer | None, **_: Any) -> list[TraceRequest]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, exc.lineno, f"invalid JSON: {exc.msg}") from None
    if not isinstance(data, list):
        raise TraceFormatError(path, 1, "expected a JSON array of conversations")
    out = []
    for index, rec in enumerate(data):
        where = f"record {index}"
        convs = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(convs, list):
            raise TraceFormatError(path, None, f"{where}: expected an object with a 'conversations' list")
        # ShareGPT dumps hold many empty or assistant-first conversations; they carry no prompt, so skip them.
        if not convs or not isinstance(convs[0], dict) or convs[0].get("from") not in ("human", "user"):
            continue
        text = convs[0].get("value")
        if not isinstance(text, str):
            raise TraceFormatError(path, None, f"{where}: first turn has no text 'value'")
        req_osl = osl
        if len(convs) > 1 and isinstance(convs[1], dict) and isinstance(convs[1].get("value"), str):
            req_osl = max(1, len(_tokenize(convs[1]["value"], tokenizer, vocab_size)))
        out.append(_text_request(name, index, None, ({"role": "user", "content": text},), req_osl, seed,
                                 vocab_size, tokenizer))
    return out


def _read_kvflow(path: Path, name: str, vocab_size: int, seed: int, tokenizer: Tokenizer | None,
                 **_: Any) -> list[TraceRequest]:
    rows = []
    for index, (lineno, rec) in enumerate(_jsonl_records(path)):
        try:
            req = InferenceRequest.model_validate(rec)
        except ValidationError as exc:
            raise TraceFormatError(
                path, lineno, f"not an InferenceRequest: {exc.errors(include_url=False)[:2]}") from None
        rows.append((index, req))
    t0 = min((r.created_ms for _, r in rows), default=0)
    out = []
    for index, req in rows:
        messages = tuple({"role": m.role, "content": m.content} for m in req.messages) if req.messages else None
        token_ids = tuple(req.token_ids) if req.token_ids is not None else None
        req_out = _text_request(name, index, req.prompt, messages, req.sampling.max_tokens, seed, vocab_size,
                                tokenizer, token_ids=token_ids, arrival_ms=float(req.created_ms - t0),
                                request_id=req.request_id)
        timeout = float(req.deadline_ms - req.created_ms) if req.deadline_ms is not None and req.created_ms else None
        out.append(replace(req_out, priority=req.priority, tenant=req.tenant or "", session_id=req.session_id,
                           timeout_ms=timeout if timeout is not None and timeout > 0 else None,
                           ttft_target_ms=req.ttft_target_ms, itl_target_ms=req.itl_target_ms))
    return out


_READERS = {"mooncake": _read_mooncake, "azure": _read_azure, "prompts": _read_prompts,
            "sharegpt": _read_sharegpt, "kvflow": _read_kvflow}


def _poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_per_s) * 1000.0
    return out


def read_trace(
    path: str | Path,
    *,
    fmt: str | None = None,
    speedup: float = 1.0,
    start_ms: float | None = None,
    end_ms: float | None = None,
    limit: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    osl: int = DEFAULT_OSL,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: Tokenizer | None = None,
) -> Trace:
    """Read a trace file into a :class:`Trace`.

    Args:
        path: the trace file.
        fmt: one of :data:`FORMATS`; detected from the file when None.
        speedup: divide arrival times by this (> 0); 2 replays twice as fast.
        start_ms, end_ms: keep requests with ``start_ms <= t < end_ms`` in
            trace time (before speedup); times are then shifted by ``start_ms``.
        limit: keep at most this many requests (after slicing).
        rate: re-time arrivals as a Poisson process of ``rate`` requests/s
            (seeded by ``seed``). Text formats without timestamps default to
            :data:`DEFAULT_PROMPT_RATE`.
        seed: seeds Poisson arrivals and unique synthetic prompts.
        osl: output length where the format gives none.
        vocab_size: range of synthetic token ids.
        tokenizer: text → token ids for text formats (default: word-hash stand-in).

    Raises:
        TraceFormatError: unreadable file, unknown format or a malformed record.
        ValueError: ``speedup``, ``rate`` or ``limit`` out of range.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if speedup <= 0 or not math.isfinite(speedup):
        raise ValueError(f"speedup must be > 0, got {speedup}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not path.exists():
        raise FileNotFoundError(path)
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise TraceFormatError(path, None, f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    name = path.stem
    requests = _READERS[fmt](path, name=name, vocab_size=vocab_size, seed=seed, osl=osl, tokenizer=tokenizer)
    requests.sort(key=lambda r: (r.arrival_ms, r.index))
    if rate is None and fmt in ("prompts", "sharegpt"):
        rate = DEFAULT_PROMPT_RATE
    if rate is not None:
        times = _poisson_arrivals(len(requests), rate, seed)
        requests = [replace(r, arrival_ms=t) for r, t in zip(requests, times, strict=True)]
    lo = start_ms if start_ms is not None else -math.inf
    hi = end_ms if end_ms is not None else math.inf
    shift = start_ms or 0.0
    requests = [r for r in requests if lo <= r.arrival_ms < hi]
    if limit is not None:
        requests = requests[:limit]
    if shift or speedup != 1.0:
        requests = [replace(r, arrival_ms=(r.arrival_ms - shift) / speedup) for r in requests]
    return Trace(name=name, path=str(path), format=fmt, requests=requests,
                 hash_block_tokens=HASH_BLOCK_TOKENS if fmt == "mooncake" else None,
                 options={"speedup": speedup, "start_ms": start_ms, "end_ms": end_ms, "limit": limit,
                          "rate": rate, "seed": seed})
