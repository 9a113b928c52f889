"""Prompt tokenization on the bridge: whole text, chunks and cache, and tiktoken, side by side.

Builds chat prompts from a Mooncake-format trace the way a load generator
does: each ``hash_ids`` entry names one ~512-token block of text (English
words drawn from a generator seeded by the id, so equal ids give equal text
and requests that share ids share a prefix). Each prompt goes through
SmolLM2's chat template, then is encoded three ways, side by side in one
run: whole by Hugging Face ``tokenizers`` (one ``encode_batch_fast`` call),
through :class:`kvflow.models.chunked_encode.ChunkCache` with ``tokenizers``
encoding the chunks, and through a ``ChunkCache`` with ``tiktoken``
encoding them (:mod:`kvflow.models.fast_bpe`; what ``HfTokenizer`` does
now), in arrival order so the caches see the trace's prefix reuse. Checks
that all three give the same ids; reports CPU ms per request
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
    tok.warm()
    fast = tok._fast_encoding()
    if fast is None:
        raise SystemExit("tiktoken does not encode SmolLM2's tokenizer here (is tiktoken installed?)")

    def hf_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok._backend.encode_batch_fast(texts, add_special_tokens=False)]

    caches = {"chunked": ChunkCache(), "tiktoken": ChunkCache()}
    ways = {"whole": lambda text: hf_batch([text])[0],
            "chunked": lambda text: caches["chunked"].encode(text, hf_batch),
            "tiktoken": lambda text: caches["tiktoken"].encode(text, tok._encode_batch)}
    cpu_ms: dict[str, list[float]] = {way: [] for way in ways}
    tokens = 0
    for chat in prompts(args.trace, args.requests):
        text = tok._render_chat(chat)
        ids = {}
        for way, encode in ways.items():
            t0 = time.process_time()
            ids[way] = encode(text)
            cpu_ms[way].append((time.process_time() - t0) * 1000)
        if not ids["whole"] == ids["chunked"] == ids["tiktoken"]:
            raise SystemExit(f"the ids differ on a {len(text)}-character prompt")
        tokens += len(ids["whole"])
    n = len(cpu_ms["whole"])
    figures: dict = {"trace": args.trace.name, "requests": n, "mean_prompt_tokens": round(tokens / n)}
    for way, values in cpu_ms.items():
        figures[f"{way}_cpu_ms_mean"] = round(statistics.fmean(values), 2)
        figures[f"{way}_cpu_ms_p99"] = round(pct(values, 99), 2)
        figures[f"{way}_cpu_us_per_token"] = round(sum(values) * 1000 / max(tokens, 1), 3)
    figures["cpu_ratio_whole_over_chunked"] = round(sum(cpu_ms["whole"]) / max(sum(cpu_ms["chunked"]), 1e-9), 2)
    figures["cpu_ratio_chunked_over_tiktoken"] = round(sum(cpu_ms["chunked"]) / max(sum(cpu_ms["tiktoken"]), 1e-9), 2)
    cache = caches["tiktoken"]
    figures["cache_hit_chars_fraction"] = round(cache.hit_chars / max(cache.hit_chars + cache.miss_chars, 1), 3)
    figures["same_ids"] = True
    print(f"{n} prompts, mean {figures['mean_prompt_tokens']} tokens, CPU ms per prompt: whole "
          f"{figures['whole_cpu_ms_mean']}, chunks+cache {figures['chunked_cpu_ms_mean']}, "
          f"chunks+cache with tiktoken {figures['tiktoken_cpu_ms_mean']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
