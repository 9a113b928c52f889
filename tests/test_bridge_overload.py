"""Overload: past ``bridge_max_inflight_requests`` the bridge answers 503 with
Retry-After before reading the body; every admitted request completes and the
count returns to zero (through a real uvicorn server)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from deployment import serve_app

from kvflow.streams.bridge.app import build_app_for_state
from test_bridge_unit import ScriptedSource, chat_body, make_state


async def test_requests_past_the_inflight_bound_get_503_and_admitted_ones_complete():
    reply = "y" * 40
    source = ScriptedSource(reply, delay_s=0.02)
    state = make_state(source, bridge_max_inflight_requests=4)
    async with serve_app(build_app_for_state(state), lifespan="off") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat_body(max_tokens=64))
                                             for _ in range(16)))
            ok = [a for a in answers if a.status_code == 200]
            shed = [a for a in answers if a.status_code == 503]
            assert len(ok) + len(shed) == 16 and shed and len(ok) >= 4
            for a in shed:
                assert a.headers["Retry-After"] == "1" and a.json()["error"]["code"] == "overloaded"
            assert all(a.json()["choices"][0]["message"]["content"] == reply for a in ok)
            assert len(source.requests) == len(ok)  # rejected ones never reached the pipeline
            assert state.inflight == 0
            again = await http.post("/v1/chat/completions", json=chat_body(max_tokens=64))
            assert again.status_code == 200 and state.inflight == 0


async def test_tokenizers_of_live_models_are_loaded_before_a_request_needs_them(waiter):
    from kvflow.streams.bridge.tokenizers import TokenizerCache, prewarm

    loads: list[str] = []
    specs: list[str] = []

    def loader(spec: str) -> str:
        loads.append(spec)
        if spec == "broken":
            raise OSError("no such tokenizer")
        return f"tok:{spec}"

    cache = TokenizerCache(loader)
    task = asyncio.create_task(prewarm(cache, lambda: specs, interval_s=0.01))
    try:
        specs.extend(["a", "broken"])
        await waiter(lambda: "a" in cache._loaded and loads.count("broken") >= 2)  # a failure is retried
        specs.append("b")
        await waiter(lambda: "b" in cache._loaded)
        assert await cache.get("a") == "tok:a" and loads.count("a") == 1  # loaded once, served from the cache
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_heartbeat_wakes_the_tokenizer_preloader_between_its_slow_checks(waiter):
    from kvflow.streams.bridge.tokenizers import TokenizerCache, prewarm

    specs = ["x"]
    changed = asyncio.Event()
    cache = TokenizerCache(lambda spec: f"tok:{spec}")
    task = asyncio.create_task(prewarm(cache, lambda: specs, interval_s=3600, changed=changed))
    try:
        await waiter(lambda: "x" in cache._loaded)  # the first check is done: parked for an hour
        specs.append("a")
        changed.set()  # a heartbeat folded in: checked now, not in an hour
        await waiter(lambda: "a" in cache._loaded)
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
