"""The bridge's tokenize pool: child processes give the ids the bridge's own
tokenizer gives, count their chunk-cache hits, report template errors, and a
dead child loses no request."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from kvflow.models.tokenizer import load_tokenizer
from kvflow.schemas import ChatMessage
from kvflow.streams.bridge import tokenize_worker
from kvflow.streams.bridge.tokenize_pool import TokenizePool, _Child, job_chars, pooled
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


async def test_a_short_prompt_goes_to_the_child_with_less_work_not_behind_a_long_one(local):
    # One long prompt on one child, one short on the other: a second short prompt joins the short
    # one (both children hold one job), so it is answered before the long prompt is.
    two = TokenizePool(2)
    try:
        assert await two.warm(SPEC)
        done: list[str] = []

        async def run(name: str, text: str) -> list[int]:
            ids = await two.encode_prompt(SPEC, text, local)
            done.append(name)
            return ids

        long_text = " ".join(f"chapter {i}: the quick brown fox jumps over the lazy dog." for i in range(30_000))
        jobs = [asyncio.create_task(run("long", long_text)),
                asyncio.create_task(run("short1", "A short question about foxes.")),
                asyncio.create_task(run("short2", "Another short question, about dogs."))]
        ids = await asyncio.gather(*jobs)
        assert ids[2] == local.encode_prompt("Another short question, about dogs.")
        assert done.index("short2") < done.index("long"), done
        assert all(not c.sizes for c in two._children)
    finally:
        await two.close()
    assert job_chars("prompt", "abc") == 3
    assert job_chars("chat", [{"role": "user", "content": "ab"}, {"role": "user", "content": None}]) == 2
    assert job_chars("warm", None) == 0


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
