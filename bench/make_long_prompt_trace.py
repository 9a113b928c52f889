"""Write a synthetic long-prompt trace in the Mooncake JSONL format.

The live-path comparison (``bench/live_path.py``, Dynamo's ``run_online.sh``)
runs on the public Mooncake conversation slice and on this trace, whose
prompts are about twice as long and whose outputs are short: the shape of
retrieval-augmented or code-completion traffic, where prefill, the KV events
of long prompts and the request records themselves dominate.

Shape (all drawn from one seeded ``numpy`` generator, so the file is
reproducible): Poisson arrivals at ``--rate`` requests/s; each request
starts with one of ``--prefixes`` shared system prompts of ``--prefix-tokens``
tokens (Zipf-like popularity, weight ``1/(k+1)``), followed by a unique body,
for a total input length uniform in ``[--min-isl, --max-isl]``; output
length uniform in ``[--min-osl, --max-osl]``. As in Mooncake, ``hash_ids``
name each 512-token block (equal ids = equal content), shared prefixes
sharing ids.

    python bench/make_long_prompt_trace.py --out examples/traces/synthetic_long_prompt.jsonl

Last stdout line: one JSON object with the trace's summary.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

BLOCK = 512  # tokens per Mooncake hash id


def make_trace(n: int, rate: float, prefixes: int, prefix_tokens: int, min_isl: int, max_isl: int,
               min_osl: int, max_osl: int, seed: int) -> list[dict]:
    """``n`` Mooncake-format rows (timestamp ms, input_length, output_length, hash_ids).

    Raises:
        ValueError: ``min_isl`` is not longer than ``prefix_tokens`` or a range is empty.
    """
    if min_isl <= prefix_tokens or max_isl < min_isl or max_osl < min_osl or n < 1:
        raise ValueError("need prefix_tokens < min_isl <= max_isl, min_osl <= max_osl and n >= 1")
    rng = np.random.default_rng(seed)
    prefix_blocks = prefix_tokens // BLOCK
    weights = 1.0 / np.arange(1, prefixes + 1)
    weights /= weights.sum()
    next_id = prefixes * prefix_blocks  # ids below this name the shared prefixes' blocks
    t_ms = 0.0
    rows = []
    for _ in range(n):
        t_ms += rng.exponential(1000.0 / rate)
        isl = int(rng.integers(min_isl, max_isl + 1))
        k = int(rng.choice(prefixes, p=weights))
        blocks = math.ceil(isl / BLOCK)
        own = blocks - prefix_blocks
        hash_ids = list(range(k * prefix_blocks, (k + 1) * prefix_blocks)) + list(range(next_id, next_id + own))
        next_id += own
        rows.append({"timestamp": int(t_ms), "input_length": isl,
                     "output_length": int(rng.integers(min_osl, max_osl + 1)), "hash_ids": hash_ids})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=1.5, help="mean arrivals per second (Poisson)")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--min-isl", type=int, default=16384)
    ap.add_argument("--max-isl", type=int, default=32768)
    ap.add_argument("--min-osl", type=int, default=32)
    ap.add_argument("--max-osl", type=int, default=160)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rows = make_trace(args.requests, args.rate, args.prefixes, args.prefix_tokens, args.min_isl, args.max_isl,
                      args.min_osl, args.max_osl, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"out": str(args.out), "requests": len(rows), "span_s": rows[-1]["timestamp"] / 1000,
                      "mean_isl": sum(r["input_length"] for r in rows) / len(rows),
                      "mean_osl": sum(r["output_length"] for r in rows) / len(rows)}))


if __name__ == "__main__":
    main()
