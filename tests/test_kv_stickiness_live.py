"""Acceptance: live KV routing keeps a prompt on the worker holding its prefix.

Run as a user runs ``kvflow up --engine mocker --workers 4 --policy kv``:
the real embedded broker, the router and bridge of a :class:`Supervisor`,
four mocker worker processes at real speed (1 s heartbeats, the default),
and HTTP requests to the bridge. The router must know a request finished
(its completion record) and fold the request's KV events before it routes
the next one, instead of waiting for the worker's next heartbeat.
"""

from __future__ import annotations

import asyncio

import httpx
from deployment import running_deployment

from kvflow.supervisor import WorkerSpec

MODEL = "mock-sticky"
WORKERS = 4
PROMPT_CHARS = 2000
"""~2,000 prompt tokens with the mocker's byte tokenizer (one token per byte)."""


def long_prompt(seed: int) -> str:
    """A distinct ~PROMPT_CHARS-character prompt; prompts of different seeds differ from their first words."""
    words = [f"w{seed}x{(seed * 7919 + i * 104729) % 100003}" for i in range(PROMPT_CHARS // 8)]
    return " ".join(words)[:PROMPT_CHARS]


async def ask(http: httpx.AsyncClient, prompt: str) -> dict:
    """One chat completion (8 output tokens); returns the parsed JSON body.

    Raises:
        AssertionError: the bridge did not answer 200.
    """
    resp = await http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": prompt}]})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_repeated_and_interleaved_prompts_stay_on_their_worker(kafka):
    settings, _ = kafka
    settings = settings.model_copy(update={"routing_policy": "kv", "heartbeat_interval_ms": 1000,
                                           "worker_ttl_ms": 5000})
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "1"])
    async with running_deployment(settings, spec, WORKERS, ready_timeout_s=120) as sup:
        async with httpx.AsyncClient(base_url=sup.url, timeout=120) as http:
            # 1. One long prompt, ten times in a row, each after the previous one finished.
            prompt = long_prompt(0)
            answers = [await ask(http, prompt) for _ in range(10)]
            workers = [a["kvflow"]["worker_id"] for a in answers]
            assert len(set(workers)) == 1, f"the repeated prompt moved between workers: {workers}"
            prompt_tokens = answers[0]["usage"]["prompt_tokens"]
            assert prompt_tokens >= 1900
            for i, a in enumerate(answers[1:], start=2):
                cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 0.9 * prompt_tokens, f"request {i}: {cached}/{prompt_tokens} tokens cached"

            # 2. Four distinct long prompts, five rounds; the four of a round are in flight together.
            prompts = [long_prompt(seed) for seed in (1, 2, 3, 4)]
            placed: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
            cached_later: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
            for round_ in range(5):
                results = await asyncio.gather(*(ask(http, p) for p in prompts))
                for i, a in enumerate(results):
                    placed[i].append(a["kvflow"]["worker_id"])
                    if round_:
                        cached_later[i].append(a["usage"]["prompt_tokens_details"]["cached_tokens"]
                                               / a["usage"]["prompt_tokens"])
        for i, where in placed.items():
            assert len(set(where)) == 1, f"prompt {i} moved between workers: {where}"
            assert min(cached_later[i]) >= 0.9, f"prompt {i}: cached fractions {cached_later[i]}"
        assert len({where[0] for where in placed.values()}) >= 3, f"four prompts on too few workers: {placed}"
