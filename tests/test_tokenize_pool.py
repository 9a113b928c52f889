"""The bridge's tokenize pool: child processes give the ids the bridge's own
tokenizer gives, count their chunk-cache hits, report template errors, take
waiting prompts in turn (a short prompt does not wait for a busy child), and a
dead child loses no request."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
from prometheus_client import generate_latest

from kvflow.models.tokenizer import load_tokenizer
from kvflow.schemas import ChatMessage
from kvflow.streams.bridge import tokenize_worker
from kvflow.streams.bridge.metrics import BridgeMetrics
from kvflow.streams.bridge.tokenize_pool import INLINE_CHARS, TokenizePool, _Child, job_chars, pooled
from kvflow.streams.bridge.tokenizers import TokenizerCache, encode_chat, encode_prompt

SPEC = "SmolLM2-135M-Instruct"

# Long enough to be cut into chunks (kvflow.models.chunked_encode cuts every ~2,048 characters).
HISTORY = " ".join(f"turn {i} of the story: the quick brown fox jumps over the lazy dog." for i in range(300))


@pytest.fixture(scope="module")
def local():
    return load_tokenizer(SPEC)


@pytest.fixture
async def pool():
    p = TokenizePool(1)
    try:
        yield p
    finally:
        await p.close()


async def test_pool_ids_equal_the_bridges_own_tokenizer_and_count_cache_hits(pool, local):
    messages = [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content=HISTORY)]
    assert await pool.warm(SPEC)
    ids = await encode_chat(local, messages, pool=pool, spec=SPEC)
    assert ids == local.encode_chat(messages)
    assert await encode_prompt(local, HISTORY, pool=pool, spec=SPEC) == local.encode_prompt(HISTORY)
    hit, encoded = pool.chunk_chars[SPEC]
    assert encoded >= len(HISTORY)  # chat and prompt cut at other places: few shared chunks
    # The same conversation again, one turn longer: its history comes from the child's cache.
    longer = [*messages, ChatMessage(role="assistant", content="Noted."), ChatMessage(role="user", content="Go on.")]
    assert await encode_chat(local, longer, pool=pool, spec=SPEC) == local.encode_chat(longer)
    assert pool.chunk_chars[SPEC][0] - hit >= len(HISTORY) - 2048
    assert pool.fallbacks == 0
    cache = TokenizerCache(pool=pool)
    await cache.get(SPEC)
    own_hit, own_encoded = (local.chunk_cache.hit_chars, local.chunk_cache.miss_chars)
    assert cache.chunk_chars()[SPEC] == (own_hit + pool.chunk_chars[SPEC][0], own_encoded + pool.chunk_chars[SPEC][1])


LONG = " ".join(f"chapter {i}: the quick brown fox jumps over the lazy dog." for i in range(30_000))
MEDIUM_A = " ".join(f"section {i}: a lazy dog sleeps under the old oak tree." for i in range(800))  # ~44k chars
MEDIUM_B = " ".join(f"part {i}: the brown fox runs across the field." for i in range(450))  # ~21k chars


async def _run_in_order(pool: TokenizePool, local, jobs: list[tuple[str, str]]) -> tuple[list[str], dict]:
    """Submit ``jobs`` (name, text) one after another; returns the names in the order answered, and the ids."""
    done: list[str] = []
    ids: dict[str, list[int]] = {}

    async def run(name: str, text: str) -> None:
        ids[name] = await pool.encode_prompt(SPEC, text, local)
        done.append(name)

    await asyncio.gather(*(asyncio.create_task(run(name, text)) for name, text in jobs))
    return done, ids


async def test_waiting_prompts_go_to_a_free_child_in_turn_and_a_short_one_does_not_wait(local):
    pool = TokenizePool(1)
    try:
        assert await pool.warm(SPEC)
        assert len(MEDIUM_B) > INLINE_CHARS
        jobs = [("long", LONG), ("medium_a", MEDIUM_A), ("short", "A short question."), ("medium_b", MEDIUM_B)]
        done, ids = await _run_in_order(pool, local, jobs)
        # The long prompt took the child; the two others waited for it, first come first served.
        assert [name for name in done if name != "short"] == ["long", "medium_a", "medium_b"], done
        # The short one found the child busy and was encoded in this process instead of waiting.
        assert pool.inline == 1 and pool.fallbacks == 0
        for name, text in jobs:
            assert ids[name] == local.encode_prompt(text), name
        assert not pool._waiting and all(not c.pending for c in pool._children)
        # With the child free again, a short prompt goes to it.
        assert await pool.encode_prompt(SPEC, "Another short one.", local) == local.encode_prompt("Another short one.")
        assert pool.inline == 1
        # The bridge's /metrics says where the prompts were encoded.
        metrics, cache = BridgeMetrics(), TokenizerCache(pool=pool)
        metrics.track_tokenizers(cache.chunk_chars, cache.pool_jobs)
        scrape = generate_latest(metrics.registry).decode()
        for path, count in (("child", 4), ("inline", 1), ("fallback", 0)):
            assert f'kvflow_bridge_tokenize_jobs_total{{path="{path}"}} {count}.0' in scrape, scrape
    finally:
        await pool.close()
    assert job_chars("prompt", "abc") == 3
    assert job_chars("chat", [{"role": "user", "content": "ab"}, {"role": "user", "content": None}]) == 2
    assert job_chars("warm", None) == 0


async def test_a_prompt_whose_caller_left_is_not_sent_to_a_child(local):
    pool = TokenizePool(1)
    try:
        assert await pool.warm(SPEC)
        long = asyncio.create_task(pool.encode_prompt(SPEC, LONG, local))
        gone = asyncio.create_task(pool.encode_prompt(SPEC, MEDIUM_A, local))
        deadline = time.monotonic() + 60
        while len(pool._waiting) < 1:  # the long prompt on the child, the other waiting for it
            assert time.monotonic() < deadline, "the prompt never queued"
            await asyncio.sleep(0.01)
        gone.cancel()
        assert await long == local.encode_prompt(LONG)
        # The child, free again, was given nothing: the waiting prompt's caller had left.
        assert gone.cancelled() and not pool._waiting and all(not c.pending for c in pool._children)
        assert await pool.encode_prompt(SPEC, MEDIUM_B, local) == local.encode_prompt(MEDIUM_B)
    finally:
        await pool.close()


async def test_prompts_waiting_for_a_child_that_dies_are_tokenized_by_the_bridge(local):
    pool = TokenizePool(1)
    try:
        assert await pool.warm(SPEC)
        (pid,) = pool.pids()
        tasks = [asyncio.create_task(pool.encode_prompt(SPEC, text, local)) for text in (LONG, MEDIUM_A, MEDIUM_B)]
        deadline = time.monotonic() + 60
        while len(pool._waiting) < 2:  # the long prompt on the child, the other two waiting for it
            assert time.monotonic() < deadline, "the prompts never queued"
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        answers = await asyncio.gather(*tasks)
        assert answers == [local.encode_prompt(text) for text in (LONG, MEDIUM_A, MEDIUM_B)]
        assert pool.fallbacks == 3 and pool.pids() == [] and not pool._waiting
    finally:
        await pool.close()


async def test_byte_tokenizer_specs_stay_in_process(pool):
    assert not pooled("bytes") and pooled(SPEC)
    tok = load_tokenizer("bytes")
    assert await encode_prompt(tok, "hello", pool=pool, spec="bytes") == tok.encode_prompt("hello")
    assert pool.pids() == []  # no child was started for it


async def test_a_killed_child_loses_no_request(pool, local, monkeypatch):
    assert await pool.warm(SPEC)
    (pid,) = pool.pids()
    os.kill(pid, signal.SIGKILL)
    # The request in flight when the child dies, and those after it while the
    # death is recent, are tokenized in the bridge's process: no process start per request.
    messages = [ChatMessage(role="user", content=HISTORY)]
    assert await encode_chat(local, messages, pool=pool, spec=SPEC) == local.encode_chat(messages)
    assert await encode_prompt(local, "still here", pool=pool, spec=SPEC) == local.encode_prompt("still here")
    assert pool.fallbacks == 2 and pool.pids() == []
    assert not await pool.warm(SPEC)
    # Once the retry time has passed, a new child takes the requests.
    monkeypatch.setattr(pool, "_broken_until", time.monotonic() - 1)
    assert await encode_prompt(local, "a new child", pool=pool, spec=SPEC) == local.encode_prompt("a new child")
    assert pool.fallbacks == 2 and len(pool.pids()) == 1 and pid not in pool.pids()


async def test_an_error_inside_the_child_falls_back_to_the_bridges_tokenizer(pool):
    class Local:
        def encode_prompt(self, text):
            return [7, 7, 7]

    # The child cannot load this spec; the bridge's own tokenizer answers.
    assert await pool.encode_prompt("/nonexistent/model-dir", "hi", Local()) == [7, 7, 7]
    assert pool.fallbacks == 1 and len(pool.pids()) == 1  # the child lives on


async def test_a_template_error_reaches_the_caller_as_a_template_error(monkeypatch):
    jinja2 = pytest.importorskip("jinja2")

    class Rejecting:
        def encode_chat(self, turns):
            raise jinja2.exceptions.TemplateSyntaxError("roles must alternate", 1)

    monkeypatch.setattr("kvflow.models.tokenizer.load_tokenizer", lambda spec: Rejecting())
    job_id, status, text, _, _ = tokenize_worker.answer((5, SPEC, "chat", [{"role": "user", "content": "x"}]))
    assert (job_id, status) == (5, "template_error") and "roles must alternate" in text

    pool = TokenizePool(1)

    async def inline(spec, kind, payload):  # the child's answer, without a child
        return tokenize_worker.answer((0, spec, kind, payload))[1:]

    monkeypatch.setattr(pool, "_run", inline)
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        await pool.encode_chat(SPEC, [ChatMessage(role="user", content="x")], Rejecting())
    assert pool.fallbacks == 0


async def test_close_passes_over_a_child_that_exited_as_its_wait_ran_out():
    """A child that ends just as ``close``'s wait runs out is already reaped when
    ``close`` kills it: seen on a loaded host as ProcessLookupError out of close."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass", stdin=asyncio.subprocess.PIPE)
    await proc.wait()
    with pytest.raises(ProcessLookupError):
        proc.kill()  # what close did, unguarded
    pool = TokenizePool(1)
    pool._children.append(_Child(proc))
    await pool.close(timeout_s=0)  # the wait "runs out" at once; the kill finds no process
    assert pool.pids() == [] and proc.returncode == 0


async def test_warm_starts_every_child(local):
    pool = TokenizePool(2)
    try:
        assert await pool.warm(SPEC)
        assert len(pool.pids()) == 2  # both loaded the spec
        assert await encode_prompt(local, HISTORY, pool=pool, spec=SPEC) == local.encode_prompt(HISTORY)
    finally:
        await pool.close()
    assert pool.pids() == []


def test_a_pool_needs_a_process():
    with pytest.raises(ValueError, match="at least one process"):
        TokenizePool(0)
