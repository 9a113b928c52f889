"""Prompt tokenization on the bridge: whole-text encoding against chunked, cached encoding.

Builds chat prompts from a Mooncake-format trace the way a load generator
does: each ``hash_ids`` entry names one ~512-token block of text (English
words drawn from a generator seeded by the id, so equal ids give equal text
and requests that share ids share a prefix). Each prompt goes through
SmolLM2's chat template, then is encoded twice, side by side in one run:
whole (one ``encode_batch_fast`` call, what the bridge did before) and
through :class:`kvflow.models.chunked_encode.ChunkCache` (what
``HfTokenizer`` does now), in arrival order so the cache sees the trace's
prefix reuse. Checks that both give the same ids; reports CPU ms per request
(``time.process_time``: this thread's process, single-threaded tokenizer
calls aside from Rust's own pool) and the cache's hit rate.

    python bench/tokenize_prompts.py [--trace examples/traces/mooncake_conversation_first40min.jsonl] [--requests 300]

Last stdout line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from kvflow.models.chunked_encode import ChunkCache
from kvflow.models.tokenizer import HfTokenizer, load_tokenizer
from kvflow.schemas import ChatMessage

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as with was on be by this are at from his an which or have not they "
         "cache prefill decode router token worker latency block request stream answer question model memory "
         "harbour crane lifted crates onto ship red grey tall small old new rusty fast").split()


def block_text(hash_id: int, words: int = 400) -> str:
    """~512 tokens of text for one hash id (the same text for the same id)."""
    rng = random.Random(hash_id)
    return " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.06 else "") for _ in range(words)) + "\n"


def prompts(trace: Path, n: int) -> list[list[ChatMessage]]:
    """The first ``n`` rows of ``trace`` as one-message chats."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()[:n] if line.strip()]
    return [[ChatMessage(role="user", content="".join(block_text(h) for h in row["hash_ids"]))] for row in rows]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main() -> None:
    """Run the comparison and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "examples/traces/mooncake_conversation_first40min.jsonl")
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()

    tok = load_tokenizer("SmolLM2-135M-Instruct")
    assert isinstance(tok, HfTokenizer) and tok.chunk_cache is not None
    cache = ChunkCache()
    whole_ms: list[float] = []
    chunked_ms: list[float] = []
    tokens = 0
    for chat in prompts(args.trace, args.requests):
        text = tok._render_chat(chat)
        t0 = time.process_time()
        whole = tok._encode_batch([text])[0]
        t1 = time.process_time()
        chunked = cache.encode(text, tok._encode_batch)
        t2 = time.process_time()
        if chunked != whole:
            raise SystemExit(f"chunked ids differ from whole ids on a {len(text)}-character prompt")
        whole_ms.append((t1 - t0) * 1000)
        chunked_ms.append((t2 - t1) * 1000)
        tokens += len(whole)
    n = len(whole_ms)
    figures = {
        "trace": args.trace.name, "requests": n, "mean_prompt_tokens": round(tokens / n),
        "whole_cpu_ms_mean": round(statistics.fmean(whole_ms), 2), "whole_cpu_ms_p99": round(pct(whole_ms, 99), 2),
        "chunked_cpu_ms_mean": round(statistics.fmean(chunked_ms), 2),
        "chunked_cpu_ms_p99": round(pct(chunked_ms, 99), 2),
        "cpu_ratio_whole_over_chunked": round(sum(whole_ms) / max(sum(chunked_ms), 1e-9), 2),
        "cache_hit_chars_fraction": round(cache.hit_chars / max(cache.hit_chars + cache.miss_chars, 1), 3),
        "same_ids": True,
    }
    print(f"{n} prompts, mean {figures['mean_prompt_tokens']} tokens: whole {figures['whole_cpu_ms_mean']} ms, "
          f"chunked+cached {figures['chunked_cpu_ms_mean']} ms of CPU per prompt")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
