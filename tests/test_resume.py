"""Resumable streams end to end on the real embedded broker.

A router and two mocker workers run in this process; bridges run in this
process (uvicorn) or as ``kvflow bridge`` processes, which the bridge-restart
test SIGKILLs mid-stream. Every resumed stream is checked against what a
fault-free stream of the same request shows: the request's final record on
the responses topic (the worker's whole output) — the streamed text must
equal its text, the event ids must number every event once, in order, and
the usage must count every token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import sys

import httpx
import pytest
from deployment import in_process_cluster, read_final, serve_bridge

from kvflow.schemas import FinalResponse, FinishReason, SamplingParams, TokenDelta
from kvflow.streams.bridge.event_ids import EventId
from kvflow.streams.broker import free_port
from kvflow.streams.client import KvflowClient
from kvflow.workers.engines.mocker_core import MockerConfig

MODEL = "mock-resume"
BRIDGE_SLOT = 7


@pytest.fixture
async def cluster(kafka, waiter):
    """``(settings, catalog, [w0, w1], client)`` behind a round-robin router."""
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=1.0, block_size=16, num_kv_blocks=4096)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker,
                                  client_timeout_s=30) as (_, workers, client):
        yield settings, catalog, workers, client


def chat(max_tokens: int, content: str = "Tell me a story.") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}


async def sse_events(resp: httpx.Response):
    """``(id or None, data)`` of each event of an SSE response, as they arrive."""
    event_id = None
    async for line in resp.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            yield event_id, line[6:]
            event_id = None


def check_stream(events: list[tuple[str | None, str]], final: FinalResponse) -> None:
    """``events`` (from one or more connections, joined) are the whole stream of the request ``final`` ends."""
    assert events[-1] == (None, "[DONE]") and [d for _, d in events].count("[DONE]") == 1
    ids = [EventId.parse(i) for i, _ in events[:-1]]
    assert [i.seq for i in ids] == list(range(len(ids)))  # no event lost or repeated
    assert {i.request_id for i in ids} == {final.request_id}
    chunks = [json.loads(d) for _, d in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == final.text
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [final.finish_reason.value]
    assert chunks[-1]["usage"]["completion_tokens"] == final.usage.completion_tokens == len(final.token_ids)


async def test_reconnect_with_last_event_id_on_the_same_bridge_loses_no_token(cluster, waiter):
    settings, catalog, workers, _ = cluster
    async with serve_bridge(settings, catalog, BRIDGE_SLOT) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            got: list[tuple[str | None, str]] = []
            async with http.stream("POST", "/v1/chat/completions", json=chat(300)) as resp:
                request_id = resp.headers["x-request-id"]
                async for event in sse_events(resp):
                    got.append(event)
                    if len(got) == 6:
                        break  # the connection drops mid-stream
            async with http.stream("POST", "/v1/chat/completions", json=chat(300),
                                   headers={"Last-Event-ID": got[-1][0]}) as resp:
                assert resp.status_code == 200 and resp.headers["x-request-id"] == request_id
                rest = [event async for event in sse_events(resp)]
            events = got + rest
            final = await read_final(settings, catalog, BRIDGE_SLOT, request_id)
            assert final.finish_reason is FinishReason.length and final.usage.completion_tokens == 300
            check_stream(events, final)

            # A finished stream can still be read again from any of its events.
            async with http.stream("POST", "/v1/chat/completions", json=chat(300),
                                   headers={"Last-Event-ID": events[1][0]}) as resp:
                assert [event async for event in sse_events(resp)] == events[2:]

    assert [w.aborted for w in workers] == [0, 0]  # the disconnect did not cancel it: it was resumed
    get = state.metrics.registry.get_sample_value
    assert get("kvflow_bridge_cancels_total", {"endpoint": "chat", "result": "sent"}) is None
    assert get("kvflow_bridge_outcomes_total",
               {"endpoint": "chat", "outcome": "aborted", "reason": "client_disconnected"}) == 1
    assert get("kvflow_bridge_outcomes_total", {"endpoint": "chat", "outcome": "completed", "reason": "length"}) == 2


async def test_a_resume_closes_the_stream_it_replaces_on_the_same_bridge(cluster):
    """A client that reconnects before the bridge noticed it left: the old
    stream is closed (one reader per request on a bridge), the new one goes on."""
    settings, catalog, workers, _ = cluster
    async with serve_bridge(settings, catalog, BRIDGE_SLOT) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=30) as old, httpx.AsyncClient(base_url=url, timeout=30) as new:
            async with old.stream("POST", "/v1/chat/completions", json=chat(400)) as resp:
                request_id = resp.headers["x-request-id"]
                old_events = sse_events(resp)
                got = [await anext(old_events) for _ in range(4)]
                async with new.stream("POST", "/v1/chat/completions", json=chat(400),
                                      headers={"Last-Event-ID": got[-1][0]}) as resumed:
                    rest = [event async for event in sse_events(resumed)]
                left = [event async for event in old_events]  # what reached it before it was closed
        assert (None, "[DONE]") not in left
        check_stream(got + rest, await read_final(settings, catalog, BRIDGE_SLOT, request_id))
        get = state.metrics.registry.get_sample_value
        assert get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "499"}) == 1
        assert get("kvflow_bridge_cancels_total", {"endpoint": "chat", "result": "sent"}) is None
    assert [w.aborted for w in workers] == [0, 0]


async def test_a_stream_not_resumed_within_the_grace_is_cancelled(cluster, waiter):
    settings, catalog, workers, _ = cluster
    async with serve_bridge(settings.model_copy(update={"stream_resume_grace_s": 0.5}), catalog,
                            BRIDGE_SLOT) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=chat(5000)) as resp:
                request_id = resp.headers["x-request-id"]
                async for _ in sse_events(resp):
                    break
        final = await read_final(settings, catalog, BRIDGE_SLOT, request_id)
        assert final.finish_reason is FinishReason.abort and final.usage.completion_tokens < 2500
        assert sum(w.aborted for w in workers) == 1
        get = state.metrics.registry.get_sample_value
        await waiter(lambda: get("kvflow_bridge_cancels_total", {"endpoint": "chat", "result": "sent"}) == 1)


async def test_kafka_native_stream_resumes_from_its_cursor_on_another_client(cluster):
    settings, catalog, _, client = cluster
    req = client.new_request(MODEL, token_ids=list(range(1, 40)), sampling=SamplingParams(max_tokens=300))
    first: list[TokenDelta] = []
    stream = client.stream(req)
    async for event in stream:
        first.append(event)
        if len(first) == 3:
            break
    cursor = stream.cursor
    await stream.aclose()  # this reader goes away; the request goes on
    assert cursor.request_id == req.request_id and cursor.partition == client.slot and cursor.delivered == 3

    other_slot = (client.slot + 1) % catalog.responses.partitions
    async with KvflowClient(settings, catalog, slot=other_slot, timeout_s=30) as other:
        rest = [event async for event in other.resume(req, cursor)]
        again = [event async for event in other.resume(req, dataclasses.replace(cursor, delivered=0))]
    deltas, final = first + rest[:-1], rest[-1]
    assert isinstance(final, FinalResponse) and final.finish_reason is FinishReason.length
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert [t for d in deltas for t in d.token_ids] == final.token_ids and len(final.token_ids) == 300
    assert again == deltas + [final]  # the whole stream, replayed from its first record


# ---------------------------------------------------------------- a bridge process killed mid-stream


async def start_bridge(settings, slot: int) -> tuple[asyncio.subprocess.Process, str]:
    """A ``kvflow bridge`` process on responses partition ``slot``, once it sees a live worker."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvflow", "bridge", "--bootstrap-servers", settings.bootstrap_servers,
        "--namespace", settings.namespace, "--embedded-broker", "--listen-port", str(port), "--slot", str(slot),
        stdin=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = asyncio.get_running_loop().time() + 90
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while True:
            assert proc.returncode is None, "the bridge process exited"
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/health")).status_code == 200:
                    return proc, url
            assert asyncio.get_running_loop().time() < deadline, "the bridge never became healthy"
            await asyncio.sleep(0.1)


async def test_streams_survive_a_bridge_killed_mid_stream(cluster):
    settings, catalog, workers, _ = cluster
    n_streams, old_slot = 8, 5
    old, old_url = await start_bridge(settings, old_slot)
    started = [asyncio.Event() for _ in range(n_streams)]
    new_url: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    broken = []

    async def one(i: int) -> tuple[str, list]:
        body = chat(600, content=f"Story number {i}.")
        got: list[tuple[str | None, str]] = []
        async with httpx.AsyncClient(timeout=60) as http:
            try:
                async with http.stream("POST", f"{old_url}/v1/chat/completions", json=body) as resp:
                    request_id = resp.headers["x-request-id"]
                    async for event in sse_events(resp):
                        got.append(event)
                        if len(got) == 3:
                            started[i].set()
            except httpx.TransportError:
                broken.append(i)
            if got[-1] == (None, "[DONE]"):
                return request_id, got  # finished before the bridge died
            url = await new_url
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                                   headers={"Last-Event-ID": got[-1][0]}) as resp:
                assert resp.status_code == 200, await resp.aread()
                got.extend([event async for event in sse_events(resp)])
        return request_id, got

    tasks = [asyncio.create_task(one(i)) for i in range(n_streams)]
    new = None
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        old.send_signal(signal.SIGKILL)
        await old.wait()
        new, url = await start_bridge(settings, old_slot + 1)
        new_url.set_result(url)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        async with httpx.AsyncClient(base_url=url) as http:
            metrics = (await http.get("/metrics")).text
    finally:
        for task in tasks:
            task.cancel()
        for proc in (old, new):
            if proc is not None and proc.returncode is None:
                proc.terminate()
                await proc.wait()

    assert len(broken) >= n_streams // 2, broken  # most streams were cut mid-stream
    for request_id, events in results:
        final = await read_final(settings, catalog, old_slot, request_id)
        assert final.finish_reason is FinishReason.length and final.usage.completion_tokens == 600
        check_stream(events, final)
    assert [w.aborted for w in workers] == [0, 0]
    resumed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith('kvflow_bridge_outcomes_total{endpoint="chat",outcome="completed"'))
    assert resumed == len(broken)
