"""The live mocker's wake-ups for what clients see (kvflow.workers.engines.mocker_delivery).

The schedule is driven here with explicit times against a reference that
delivers every step at its end, so the comparisons are exact and do not
depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvflow.schemas import FinishReason, SamplingParams
from kvflow.workers.engines.base import GenerateRequest
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore, min_step_ms, prefill_time_ms
from kvflow.workers.engines.mocker_delivery import EARLY_S, StepDelivery


def req(rid: str, n_prompt: int, max_tokens: int, seed: int = 0, stop: list[str] | None = None) -> GenerateRequest:
    rng = random.Random(seed)
    return GenerateRequest(rid, [rng.randrange(49152) for _ in range(n_prompt)],
                           SamplingParams(max_tokens=max_tokens, stop=stop or []))


def workload(seed: int, n: int, spacing_s: float) -> list[tuple[float, GenerateRequest]]:
    """``n`` requests at random times, some sharing a prompt prefix, prompts 50..9,000 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(49152) for _ in range(2048)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.uniform(0.0, spacing_s)
        body = [rng.randrange(49152) for _ in range(rng.randint(50, 7000))]
        prompt = (shared + body) if rng.random() < 0.4 else body
        out.append((t, GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 120)))))
    return out


def every_step_at_its_end(config: MockerConfig,
                          arrivals: list[tuple[float, GenerateRequest]]) -> dict[str, list[float]]:
    """Reference: the plain live engine on an exact clock. A request joins the first
    step that starts after it arrives; each step's tokens are delivered at its end.
    Returns request id -> the end time of each of its tokens."""
    core, pending = MockerCore(config), list(arrivals)
    times: dict[str, list[float]] = {}
    next_start: float | None = None
    while pending or core.has_work():
        if not core.has_work():
            t, first = pending.pop(0)
            core.add_request(first)
            start = t if next_start is None or next_start < t else next_start
        else:
            start = next_start
        while pending and pending[0][0] < start:
            core.add_request(pending.pop(0)[1])
        step = core.step(now_ms=start * 1000.0)
        assert step.outputs or step.duration_ms > 0, "the reference cannot stall"
        end = start + step.duration_ms / 1000.0
        for rid, out in step.outputs.items():
            times.setdefault(rid, []).extend([end] * len(out.token_ids))
        next_start = end
    return times


def drive(delivery: StepDelivery, arrivals: list[tuple[float, GenerateRequest]]):
    """Run ``delivery`` as the engine's loop would, waking exactly when it asks.
    Returns (deliveries: list of (time, request id, output), number of wake-ups)."""
    pending = list(arrivals)
    got, wakes = [], 0
    while True:
        wake = delivery.next_wake()
        if pending and (wake is None or pending[0][0] <= wake):
            t, request = pending.pop(0)
            delivered = delivery.add(request, t)
        elif wake is not None:
            t = wake
            delivered = delivery.advance(t)
            wakes += 1
        else:
            return got, wakes
        got += [(t, rid, out) for rid, out in delivered[0].items()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_tokens_and_finishes_keep_their_times_and_the_rest_wait_at_most_one_tick(seed):
    config = MockerConfig(block_size=16, num_kv_blocks=4096, max_num_batched_tokens=2048)
    arrivals = workload(seed, 40, spacing_s=0.3)
    reference = every_step_at_its_end(config, arrivals)
    interval = 0.08
    delivery = StepDelivery(MockerCore(config), interval)
    got, _ = drive(delivery, arrivals)

    tokens: dict[str, list[tuple[float, int, FinishReason | None]]] = {}
    for t, rid, out in got:
        tokens.setdefault(rid, []).append((t, len(out.token_ids), out.finish_reason))
    assert set(tokens) == set(reference)
    for rid, ends in reference.items():
        outputs = tokens[rid]
        assert sum(n for _, n, _ in outputs) == len(ends), rid
        assert [f for _, _, f in outputs][-1] is FinishReason.length
        assert all(f is None for _, _, f in outputs[:-1])
        # The first token alone, at its step's end; the last at its step's end.
        assert outputs[0][1] == 1 and outputs[0][0] == pytest.approx(ends[0], abs=EARLY_S)
        assert outputs[-1][0] == pytest.approx(ends[-1], abs=EARLY_S)
        # Any other token: not before its step ended, at most one tick after.
        index = 0
        for t, n, _ in outputs:
            first_end, last_end = ends[index], ends[index + n - 1]
            assert t >= last_end - EARLY_S
            assert t <= first_end + interval + 1e-9
            index += n


def test_long_decodes_wake_about_once_per_tick():
    config = MockerConfig(block_size=16)
    delivery = StepDelivery(MockerCore(config), 0.08)
    arrivals = [(0.0, req("a", 300, 400, seed=1)), (0.01, req("b", 300, 300, seed=2)),
                (0.02, req("c", 300, 350, seed=3))]
    got, wakes = drive(delivery, arrivals)
    steps = len({t for t in every_step_at_its_end(config, arrivals)["a"]})
    assert sum(len(out.token_ids) for _, _, out in got) == 1050
    # ~6-9 ms decode steps, an 80 ms tick: about one wake per ten steps, plus first tokens and finishes.
    assert wakes < steps / 5, (wakes, steps)


def test_a_step_handed_over_early_still_leaves_a_wake_for_the_next():
    """A step ending within EARLY_S of a wake is delivered then; the steps after it
    must still be woken for on the tick, not only at the request's far finish."""
    delivery = StepDelivery(MockerCore(MockerConfig(block_size=16)), 0.08)
    delivery.add(req("a", 50, 100_000), 0.0)
    delivery.advance(0.0)
    end = delivery.in_flight(0.0).duration_ms / 1000
    delivery.advance(end - EARLY_S / 2)  # hands over the first token before its step quite ended
    assert not delivery.holding
    assert delivery.next_wake() <= 0.08 + 1e-9


def test_a_request_with_stop_strings_is_delivered_every_step():
    config = MockerConfig(block_size=16)
    delivery = StepDelivery(MockerCore(config), 0.08)
    got, _ = drive(delivery, [(0.0, req("plain", 100, 30, seed=1)),
                              (0.001, req("stops", 100, 30, seed=2, stop=["zz"]))])
    plain = [out for _, rid, out in got if rid == "plain"]
    # While "stops" runs (both decode in every step) "plain" gets one token per delivery too.
    assert [len(o.token_ids) for o in plain[1:29]] == [1] * 28
    alone = StepDelivery(MockerCore(config), 0.08)
    got, _ = drive(alone, [(0.0, req("plain", 100, 30, seed=1))])
    assert max(len(out.token_ids) for _, _, out in got) > 1  # without it, tokens wait for a tick


def test_an_arrival_joins_the_step_after_the_one_running():
    config = MockerConfig(block_size=16)
    delivery = StepDelivery(MockerCore(config), 0.08)
    delivery.add(req("a", 64, 50), 0.0)
    assert delivery.next_wake() == 0.0  # its step starts at its arrival
    delivery.advance(0.0)
    first = delivery.in_flight(0.0)
    first_end = first.duration_ms / 1000
    assert first.prefill_tokens == 64 and first_end > prefill_time_ms(config, 64) / 1000
    assert delivery.next_wake() == pytest.approx(first_end)  # a's first token
    outputs, _ = delivery.advance(first_end)
    assert [len(o.token_ids) for o in outputs.values()] == [1]
    # 20 ms later several decode steps have started and ended; b arrives during the one running now.
    outputs, _ = delivery.add(req("b", 64, 5, seed=3), first_end + 0.02)
    assert len(outputs["a"].token_ids) >= 2  # catching up hands over the steps that ended
    counts = {"a": 1 + len(outputs["a"].token_ids), "b": 0}
    running = delivery.in_flight(first_end + 0.02)
    assert running is not None and set(running.outputs) == {"a"}  # b waits for the next step
    while delivery.next_wake() is not None:
        outputs, _ = delivery.advance(delivery.next_wake())
        for rid, out in outputs.items():
            counts[rid] += len(out.token_ids)
    assert counts == {"a": 50, "b": 5}


def test_abort_catches_up_first_and_frees_the_blocks():
    config = MockerConfig(block_size=16)
    core = MockerCore(config)
    delivery = StepDelivery(core, 0.08)
    delivery.add(req("a", 64, 1000), 0.0)
    delivery.advance(0.0)
    delivered, _ = delivery.abort("a", 0.5)
    assert len(delivered["a"].token_ids) > 1  # the steps before the abort were delivered
    assert not core.has_work() and core.pool.num_used_blocks == 0
    assert delivery.next_wake() is not None  # the step running at the abort still ends
    delivery.advance(delivery.next_wake())
    assert delivery.next_wake() is None and not delivery.holding


def test_held_kv_events_are_taken_once():
    delivery = StepDelivery(MockerCore(MockerConfig(block_size=16)), 0.08)
    delivery.add(req("a", 200, 3), 0.0)
    delivery.advance(0.0)
    early = delivery.take_held_events()
    assert early and delivery.take_held_events() == []
    _, later = delivery.advance(10.0)
    assert all(e not in later for e in early)


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        StepDelivery(MockerCore(MockerConfig()), 0.0)
    with pytest.raises(ValueError):
        MockerEngine(output_interval_s=-1.0)


# ---- the bounds the schedule relies on ---------------------------------------------------


@pytest.mark.parametrize("spec", [0, 3])
def test_quiet_steps_never_hide_a_first_token_or_a_finish(spec):
    """Random arrivals on a small KV pool (preemptions) and a small budget (chunked prefill):
    after every step, the next ``quiet_steps()`` steps emit no first token and no finish."""
    config = MockerConfig(block_size=16, num_kv_blocks=200, max_num_batched_tokens=512,
                          spec_num_draft_tokens=spec)
    core, rng = MockerCore(config), random.Random(spec)
    seen: set[str] = set()
    checked = longest = 0
    for i in range(600):
        if rng.random() < 0.15:
            core.add_request(req(f"r{i}", rng.randint(20, 1500), rng.randint(1, 200), seed=i))
        if not core.has_work():
            continue
        quiet = core.quiet_steps()
        longest = max(longest, quiet)
        for _ in range(quiet):
            step = core.step()
            for rid, out in step.outputs.items():
                assert rid in seen, f"first token of {rid} inside {quiet} quiet steps"
                assert out.finish_reason is None, f"{rid} finished inside {quiet} quiet steps"
            checked += 1
        step = core.step()
        seen.update(step.outputs)
    assert core.num_preemptions > 0 and checked > 100 and longest >= 20


def test_quiet_steps_counts():
    config = MockerConfig(block_size=16, max_num_batched_tokens=1000)
    core = MockerCore(config)
    assert core.quiet_steps() == 0
    core.add_request(req("a", 2500, 10))
    assert core.quiet_steps() == 0  # waiting: may be admitted and sample next step
    core.step()  # 1,000 of 2,500 prompt tokens
    assert core.quiet_steps() == 1  # 1,500 left: two more steps, the second samples
    core.step()
    core.step()  # first token
    assert core.quiet_steps() == 8  # nine tokens to go: the ninth step finishes


def test_min_step_ms_bounds_every_step():
    config = MockerConfig(block_size=16, num_kv_blocks=400, max_num_batched_tokens=300, speedup_ratio=2.0)
    assert min_step_ms(MockerConfig()) == pytest.approx(5.74)  # the decode polynomial at usage 0
    assert min_step_ms(config) == pytest.approx(5.74 / 2)
    assert min_step_ms(MockerConfig(prefill_coeffs=(0.0, 0.0, 0.5))) == pytest.approx(0.5)
    assert min_step_ms(MockerConfig(prefill_coeffs=(0.0, -1.0, 0.0))) == 0.0  # floored at 0
    core, rng = MockerCore(config), random.Random(5)
    least = min_step_ms(config)
    for i in range(300):
        if rng.random() < 0.1:
            core.add_request(req(f"r{i}", rng.randint(1, 900), rng.randint(1, 60), seed=i))
        if core.has_work():
            step = core.step()
            if step.outputs or step.prefill_tokens:
                assert step.duration_ms >= least - 1e-9


# ---- the engine on the wall clock ----------------------------------------------------------


async def test_engine_wakes_less_than_once_per_step_and_streams_every_token():
    engine = MockerEngine(MockerConfig(block_size=16, speedup_ratio=4.0), output_interval_s=0.05)
    steps = wakes = 0
    step, advance = engine.core.step, engine._delivery.advance

    def counting_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        return step(*args, **kwargs)

    def counting_advance(now):
        nonlocal wakes
        wakes += 1
        return advance(now)

    engine.core.step, engine._delivery.advance = counting_step, counting_advance
    await engine.start()

    async def consume(rid: str, n: int):
        return [out async for out in engine.generate(req(rid, 300, n, seed=len(rid)))]

    try:
        a, b = await asyncio.wait_for(asyncio.gather(consume("a", 200), consume("bb", 150)), 60)
    finally:
        await engine.stop()
    assert sum(len(o.token_ids) for o in a) == 200 and a[-1].finish_reason is FinishReason.length
    assert sum(len(o.token_ids) for o in b) == 150 and b[-1].finish_reason is FinishReason.length
    # Whether the first token came alone depends on how late the event loop woke
    # (a late loop merges the steps that ended meanwhile): the driven-clock test
    # above checks its timing.
    assert wakes < steps / 2, (wakes, steps)
    assert engine.kv_stats().used_blocks == 0


async def test_engine_abort_ends_the_stream_with_abort():
    engine = MockerEngine(MockerConfig(block_size=16, speedup_ratio=4.0), output_interval_s=0.05)
    await engine.start()
    got = []
    try:
        async for out in engine.generate(req("a", 50, 100_000)):
            got.append(out)
            if len(got) == 3:
                await engine.abort("a")
    finally:
        await engine.stop()
    assert got[-1].finish_reason is FinishReason.abort
    assert engine.kv_stats().used_blocks == 0 and not engine.core.has_work()


def test_a_mocker_worker_follows_its_delta_flush_period():
    from kvflow.settings import Settings
    from kvflow.workers.main import build_engine, mocker_output_interval_s

    assert mocker_output_interval_s(Settings(stream_flush_ms=80)) == pytest.approx(0.08)
    assert mocker_output_interval_s(Settings(stream_flush_ms=80, mocker_output_interval_ms=30)) == pytest.approx(0.03)
    assert mocker_output_interval_s(Settings(stream_flush_ms=80, mocker_output_interval_ms=0)) == 0.0
    lazy, _, _ = build_engine("mocker", "m", mocker_output_interval_s=0.08)
    plain, _, _ = build_engine("mocker", "m")
    assert lazy._delivery is not None and lazy._delivery.interval_s == pytest.approx(0.08)
    assert plain._delivery is None
