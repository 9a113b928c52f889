"""Reports: statistics against numpy and hand-computed values, JSON, markdown, plots, compare."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvflow.replay.compare import compare, compare_reports
from kvflow.replay.offline import run_offline
from kvflow.replay.plots import latency_samples, write_plots
from kvflow.replay.report import (
    Report,
    RequestRecord,
    TimelineSample,
    attainment_interval,
    build_report,
    latency_stats,
    load_report,
    render_markdown,
    write_json,
)

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_latency_stats_match_numpy():
    rng = np.random.default_rng(0)
    data = rng.lognormal(3.0, 1.0, 10_001)
    s = latency_stats(data)
    assert (s.p50, s.p90, s.p99) == pytest.approx(tuple(np.percentile(data, [50, 90, 99])))
    assert s.mean == pytest.approx(data.mean()) and s.count == data.size


def test_latency_stats_small_known_values():
    s = latency_stats([1.0, 2.0, 3.0, 4.0])
    # linear interpolation: rank = p/100 * (n-1)
    assert (s.p50, s.p90, s.p99, s.mean) == pytest.approx((2.5, 3.7, 3.97, 2.5))
    empty = latency_stats([])
    assert (empty.count, empty.p50, empty.mean) == (0, None, None)


def records() -> list[RequestRecord]:
    return [
        # TTFT 100, 5 tokens over 100..500: TPOT (500-100)/4 = 100, e2e 500, queue 10
        RequestRecord("a", 0.0, 1000, 5, "w0", scheduled_ms=10.0, first_token_ms=100.0, last_token_ms=500.0,
                      finish_ms=500.0, output_tokens=5, cached_tokens=500),
        # TTFT 50, 3 tokens over 1050..1090: TPOT 20, e2e 90, queue 0
        RequestRecord("b", 1000.0, 200, 3, "w1", scheduled_ms=1000.0, first_token_ms=1050.0, last_token_ms=1090.0,
                      finish_ms=1090.0, output_tokens=3, cached_tokens=0),
        # one token: TTFT 600 (misses the 500 ms SLA), no TPOT, queue 0
        RequestRecord("c", 2000.0, 300, 1, "w0", scheduled_ms=2000.0, first_token_ms=2600.0, last_token_ms=2600.0,
                      finish_ms=2600.0, output_tokens=1, cached_tokens=100),
        RequestRecord("d", 3000.0, 50, 4, "w1", error="boom"),
    ]


def make_report(**kw) -> Report:
    args = dict(mode="offline", trace="t", trace_format="mooncake", policy="round_robin",
                workers=["w0", "w1", "w2"], seed=3, busy_ms={"w0": 1300.0, "w1": 0.0},
                block_size=64, total_kv_blocks=300,
                timeline=[TimelineSample(1000.0, [1, 0, 0], [0.5, 0.0, 0.0], 1000, 500, 1)])
    args.update(kw)
    return build_report(records(), [100.0, 100.0, 100.0, 100.0, 20.0, 20.0], **args)


def test_build_report_by_hand():
    r = make_report()
    assert (r.requests, r.completed, r.failed) == (4, 3, 1)
    assert r.duration_s == pytest.approx(2.6)
    assert r.ttft_ms.count == 3 and r.ttft_ms.p50 == pytest.approx(100.0) and r.ttft_ms.mean == pytest.approx(250.0)
    assert r.tpot_ms.count == 2 and r.tpot_ms.mean == pytest.approx(60.0)
    assert r.e2e_ms.p50 == pytest.approx(500.0)
    assert r.queue_ms.mean == pytest.approx(10 / 3)
    assert r.itl_ms.count == 6 and r.itl_ms.p50 == pytest.approx(100.0)
    assert r.prefix_hit_rate == pytest.approx(600 / 1500)
    assert r.output_tokens == 9 and r.output_tokens_per_s == pytest.approx(9 / 2.6)
    assert r.requests_per_s == pytest.approx(3 / 2.6)
    # SLA 500 ms / 50 ms: a fails TPOT (100), b passes, c fails TTFT (600)
    assert r.goodput.fraction == pytest.approx(1 / 4) and r.goodput.requests_per_s == pytest.approx(1 / 2.6)
    relaxed = make_report(sla_ttft_ms=1000, sla_itl_ms=150)
    assert relaxed.goodput.fraction == pytest.approx(3 / 4)
    w = {x.worker_id: x for x in r.per_worker}
    assert (w["w0"].requests, w["w0"].prompt_tokens, w["w0"].prefix_hit_rate) == (2, 1300, pytest.approx(600 / 1300))
    assert w["w0"].busy_fraction == pytest.approx(1300 / 2600)
    assert w["w2"].requests == 0 and w["w2"].busy_fraction == 0.0
    assert r.timeline[0].hit_rate == pytest.approx(0.5) and r.timeline[0].t_s == 1.0
    assert (r.block_size, r.total_kv_blocks, r.policy, r.seed, r.workers) == (64, 300, "round_robin", 3, 3)


def minute_records(pattern: list[list[bool]]) -> list[RequestRecord]:
    """Requests by minute of arrival: ``pattern[m][i]`` says whether request i of minute m meets 500/50 ms."""
    out = []
    for m, minute in enumerate(pattern):
        for i, ok in enumerate(minute):
            t = m * 60_000.0 + i * 100.0
            ttft = 100.0 if ok else 900.0
            out.append(RequestRecord(f"{m}-{i}", t, 100, 2, "w0", first_token_ms=t + ttft, last_token_ms=t + ttft + 10,
                                     finish_ms=t + ttft + 10, output_tokens=2))
    return out


def test_attainment_interval_by_hand():
    # two minutes, one all met, one all missed: resamples give 0, 0.5 or 1 with
    # probabilities 1/4, 1/2, 1/4, so the 2.5% and 97.5% quantiles are 0 and 1
    two = minute_records([[True] * 4, [False] * 4])
    assert attainment_interval(two, 500, 50) == (0.0, 1.0)
    r = build_report(two, [], mode="offline", trace="t", trace_format="mooncake", policy="p", workers=["w0"], seed=0)
    assert r.sla_attainment_ci95 == (0.0, 1.0) and "95% interval 0.00%–100.00%" in render_markdown(r)
    assert "| SLA attainment (95% interval) | 50.00% (0.00%–100.00%) |" in compare([r]).splitlines()
    # every minute at 3/4: every resample is 3/4
    same = minute_records([[True, True, True, False]] * 5)
    assert attainment_interval(same, 500, 50) == pytest.approx((0.75, 0.75))
    # one minute of arrivals, or none: no interval
    assert attainment_interval(minute_records([[True, False]]), 500, 50) is None
    assert attainment_interval([], 500, 50) is None
    with pytest.raises(ValueError):
        attainment_interval(two, 500, 50, level=1.0)


def test_attainment_interval_narrows_with_more_minutes_and_holds_the_estimate():
    rng = np.random.default_rng(1)
    def minutes(k):
        return minute_records([list(rng.random(50) < p) for p in rng.uniform(0.8, 1.0, k)])
    few, many = minutes(10), minutes(200)
    lo_f, hi_f = attainment_interval(few, 500, 50)
    lo_m, hi_m = attainment_interval(many, 500, 50)
    for recs, lo, hi in ((few, lo_f, hi_f), (many, lo_m, hi_m)):
        point = make_sla(recs)
        assert lo < point < hi
    assert hi_m - lo_m < (hi_f - lo_f) / 2  # ~1/sqrt(20) of the width
    assert attainment_interval(many, 500, 50, seed=5) != (lo_m, hi_m)  # resampled, not fixed
    assert attainment_interval(many, 500, 50) == (lo_m, hi_m)  # deterministic per seed


def make_sla(recs: list[RequestRecord]) -> float:
    r = build_report(recs, [], mode="offline", trace="t", trace_format="mooncake", policy="p", workers=["w0"], seed=0)
    assert r.sla_attainment_ci95 == attainment_interval(recs, 500, 50)
    return r.sla_attainment


def test_json_roundtrip_and_markdown(tmp_path):
    r = make_report()
    write_json(r, tmp_path / "sub" / "r.json")
    data = json.loads((tmp_path / "sub" / "r.json").read_text())
    for key in ("requests", "completed", "failed", "duration_s", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms",
                "prefix_hit_rate", "output_tokens_per_s", "requests_per_s", "goodput", "block_size",
                "total_kv_blocks", "per_worker", "policy", "workers", "seed", "trace"):
        assert key in data
    assert set(data["ttft_ms"]) >= {"p50", "p90", "p99", "mean"}
    assert load_report(tmp_path / "sub" / "r.json") == r
    md = render_markdown(r)
    assert "| TTFT | 100.0 |" in md and "40.0%" in md and "| w0 | 2 |" in md


def test_compare_tables_reports_side_by_side(tmp_path):
    a, b = make_report(), make_report(policy="random", sla_ttft_ms=1000, sla_itl_ms=150)
    write_json(a, tmp_path / "rr.json")
    write_json(b, tmp_path / "rand.json")
    table = compare_reports([tmp_path / "rr.json", tmp_path / "rand.json"])
    lines = table.splitlines()
    assert lines[0] == "| metric | rr | rand |"
    assert "| policy | round_robin | random |" in lines
    assert "| goodput (req/s) | 0.38 (25.0%) | 1.15 (75.0%) |" in lines
    assert "| SLA attainment (95% interval) | 25.00% | 75.00% |" in lines  # one minute of arrivals: no interval
    assert "| prefix hit rate | 40.0% | 40.0% |" in lines
    with pytest.raises(ValueError):
        compare([])


def test_plots_are_written(tmp_path):
    r = make_report()
    samples = latency_samples(records(), [100.0, 20.0])
    assert list(samples["ttft"]) == [100.0, 50.0, 600.0]
    paths = write_plots(r, samples, tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "timeline.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


def test_run_offline_writes_every_output(tmp_path):
    rep = run_offline(TRACES / "azure2023_conv.csv", workers=2, policy="round_robin", limit=60,
                      json_path=tmp_path / "r.json", markdown_path=tmp_path / "r.md", plot_dir=tmp_path / "p",
                      progress=False)
    assert rep.completed == 60 and rep.failed == 0 and rep.trace == "azure2023_conv"
    assert rep.prefix_hit_rate < 0.05  # unique prompts: only chance hits
    assert sum(w.requests for w in rep.per_worker) == 60 and [w.requests for w in rep.per_worker] == [30, 30]
    assert rep.total_kv_blocks == 2 * 16384 and rep.block_size == 64
    assert load_report(tmp_path / "r.json") == rep
    assert (tmp_path / "r.md").read_text().startswith("# Replay of `azure2023_conv` (offline)")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["latency_cdf.png", "timeline.png"]


def fake_openai_app(cached_tokens: int, token_delay_s: float):
    """A streaming OpenAI-style server: ``max_tokens`` one-token chunks, then usage and kvflow's worker id."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def serve(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        prompt_tokens = len(body["messages"][0]["content"].split()) if chat else len(body["prompt"])
        if not body.get("stream") or not body.get("ignore_eos"):
            return JSONResponse({"error": {"message": "expected stream and ignore_eos"}}, status_code=400)

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(token_delay_s)
                choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached_tokens}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage, 'kvflow': {'worker_id': 'w-a'}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", serve, methods=["POST"]),
                             Route("/v1/chat/completions", serve, methods=["POST"])])


async def test_online_http_replay_fills_the_same_report_shape(tmp_path):
    import asyncio
    import socket

    import uvicorn

    from kvflow.replay.online import run_online_async

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_openai_app(cached_tokens=8, token_delay_s=0.01),
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        lines = [json.dumps({"timestamp": 30 * i, "input_length": 100 + i, "output_length": 4, "hash_ids": [i]})
                 for i in range(5)]
        trace = tmp_path / "mini.jsonl"
        trace.write_text("\n".join(lines) + "\n")
        rep = await run_online_async(trace, url=f"http://127.0.0.1:{port}", json_path=tmp_path / "on.json",
                                     progress=False, sample_interval_ms=50)
        chat = await run_online_async(TRACES / "mtbench_question.jsonl", url=f"http://127.0.0.1:{port}",
                                      limit=2, rate=50.0, progress=False)
    finally:
        server.should_exit = True
        await task
    assert (rep.mode, rep.completed, rep.failed, rep.output_tokens) == ("online", 5, 0, 20)
    assert rep.prompt_tokens == sum(100 + i for i in range(5))  # the server saw ISL-long token prompts
    assert rep.prefix_hit_rate == pytest.approx(5 * 8 / rep.prompt_tokens)
    assert rep.itl_ms.count == 15 and rep.itl_ms.p50 >= 5.0  # 3 gaps per request, ~10 ms each
    assert rep.ttft_ms.p50 >= 5.0 and rep.tpot_ms.count == 5
    assert [w.worker_id for w in rep.per_worker] == ["w-a"] and rep.per_worker[0].busy_fraction is None
    offline_keys = set(make_report().model_dump())
    assert set(json.loads((tmp_path / "on.json").read_text())) == offline_keys
    assert chat.completed == 2 and chat.output_tokens == 2 * 256


class FakeKafkaClient:
    """The KvflowClient API (new_request / stream) answered in-process: one TokenDelta per token."""

    def __init__(self) -> None:
        self.sent = []

    def new_request(self, model, *, messages=None, prompt=None, token_ids=None, sampling=None, request_id=None):
        from kvflow.schemas import InferenceRequest, ReplyTo

        return InferenceRequest(request_id=request_id, model=model, messages=messages, prompt=prompt,
                                token_ids=token_ids, sampling=sampling, reply_to=ReplyTo(topic="r", partition=0),
                                created_ms=1_000)

    async def stream(self, request, key=None):
        import asyncio

        from kvflow.schemas import FinalResponse, FinishReason, Timings, TokenDelta, Usage

        self.sent.append(request)
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(0.005)
            yield TokenDelta(request_id=request.request_id, index=i, token_ids=[i])
        isl = len(request.token_ids)
        yield FinalResponse(request_id=request.request_id, token_ids=list(range(n)), finish_reason=FinishReason.length,
                            usage=Usage(prompt_tokens=isl, completion_tokens=n, cached_tokens=isl // 2),
                            worker_id=f"w{isl % 2}", timings=Timings(started_ms=1_003))


async def test_online_kafka_replay_with_a_client(tmp_path):
    from kvflow.replay.online import run_online_async

    lines = [json.dumps({"timestamp": 20 * i, "input_length": 64 + i, "output_length": 3, "hash_ids": [i]})
             for i in range(4)]
    trace = tmp_path / "mini.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    client = FakeKafkaClient()
    rep = await run_online_async(trace, client=client, progress=False)
    assert [len(r.token_ids) for r in client.sent] == [64, 65, 66, 67]
    assert all(r.sampling.max_tokens == 3 and r.sampling.ignore_eos for r in client.sent)
    assert (rep.completed, rep.output_tokens, rep.itl_ms.count) == (4, 12, 8)
    assert rep.prefix_hit_rate == pytest.approx(sum((64 + i) // 2 for i in range(4)) / sum(64 + i for i in range(4)))
    assert sorted(w.worker_id for w in rep.per_worker) == ["w0", "w1"]
    assert rep.queue_ms.mean == pytest.approx(3.0)  # started 3 ms after the request was created
    assert rep.itl_ms.p50 >= 4.0
