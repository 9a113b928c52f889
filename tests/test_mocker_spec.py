"""Speculative decoding in the mocker core: output, KV accounting, acceptance statistics."""

from __future__ import annotations

import pytest

from kvflow.schemas import BlockStored, SamplingParams
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore

BS = 16


def run(k: int, alpha: float = 0.7, *, n: int = 1, cost: float = 0.0, max_tokens: int = 200) -> dict:
    core = MockerCore(MockerConfig(block_size=BS, num_kv_blocks=4000, spec_num_draft_tokens=k,
                                   spec_acceptance_rate=alpha, spec_draft_cost_ratio=cost))
    for i in range(n):
        core.add_request(GenerateRequest(f"r{i}", list(range(i * 1000, i * 1000 + 100)),
                                         SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
    stored: list[int] = []
    steps, duration, peak_blocks = 0, 0.0, 0
    while core.has_work():
        res = core.step()
        steps += 1
        duration += res.duration_ms
        peak_blocks = max(peak_blocks, core.pool.num_used_blocks)
        for rid, out in res.outputs.items():
            tokens[rid] += out.token_ids
        stored += [h for e in res.kv_events if isinstance(e, BlockStored) for h in e.block_hashes]
    return {"tokens": tokens, "stored": stored, "steps": steps, "duration": duration, "core": core,
            "peak_blocks": peak_blocks}


def test_speculation_changes_timing_not_output():
    plain, spec = run(0), run(4, 0.7)
    assert spec["tokens"] == plain["tokens"] and len(spec["tokens"]["r0"]) == 200
    assert spec["steps"] < plain["steps"] / 2 and spec["duration"] < plain["duration"] / 2


def test_only_accepted_tokens_become_blocks_and_kv_events():
    plain, spec = run(0), run(4, 0.7)
    assert spec["stored"] == plain["stored"]  # same blocks, same order: rejected drafts never stored
    none_accepted = run(4, 0.0)
    assert none_accepted["stored"] == plain["stored"] and none_accepted["core"].spec_accepted_tokens == 0
    # draft slots are over-allocated while the request runs, and all returned at its end
    assert spec["peak_blocks"] >= plain["peak_blocks"] and spec["core"].pool.num_used_blocks == 0


def test_acceptance_statistics_follow_the_model():
    k, alpha = 4, 0.7
    core = run(k, alpha, n=40, max_tokens=400)["core"]
    mean_len = 1 + core.spec_accepted_tokens / core.spec_verify_steps
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)  # Leviathan et al. 2023, tokens per target pass
    assert mean_len == pytest.approx(expected, rel=0.08)
    assert core.spec_accepted_tokens / core.spec_draft_tokens == pytest.approx((expected - 1) / k, rel=0.1)


def test_draft_cost_slows_each_step():
    cheap, costly = run(4, 0.7), run(4, 0.7, cost=0.2)
    assert cheap["steps"] == costly["steps"] and costly["duration"] > 1.5 * cheap["duration"]


def test_bad_settings_are_refused():
    for kw in ({"spec_num_draft_tokens": -1}, {"spec_num_draft_tokens": 256}, {"spec_acceptance_rate": 1.5},
               {"spec_draft_cost_ratio": -0.1}):
        with pytest.raises(ValueError):
            MockerConfig(**kw)


async def test_live_mocker_engine_streams_several_tokens_per_step_and_reports_counters():
    from kvflow.workers.engines.mocker import MockerEngine

    async def generate(cfg: MockerConfig) -> tuple[list[list[int]], MockerEngine]:
        engine = MockerEngine(cfg)
        await engine.start()
        try:
            chunks = [o.token_ids async for o in engine.generate(
                GenerateRequest("a", list(range(300)), SamplingParams(max_tokens=60, ignore_eos=True)))]
        finally:
            await engine.stop()
        return chunks, engine

    plain, plain_engine = await generate(MockerConfig(block_size=BS, speedup_ratio=100.0))
    spec, spec_engine = await generate(MockerConfig(block_size=BS, speedup_ratio=100.0, spec_num_draft_tokens=4,
                                                    spec_acceptance_rate=0.8))
    assert [t for c in spec for t in c] == [t for c in plain for t in c]
    assert len(spec) < len(plain) and max(len(c) for c in spec) > 1
    assert plain_engine.spec_decode_metrics() is None
    m = spec_engine.spec_decode_metrics()
    assert m.accepted_tokens > 0 and m.mean_accepted_length > 1
