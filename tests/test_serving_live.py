"""Live: a request's serving class travels from the HTTP headers to the router's decision record,
and a mocker worker that speculates reports its draft and accepted tokens on the metrics topic."""

from __future__ import annotations

import httpx

from deployment import first_record, running_deployment
from kvflow.schemas import MetricRecord, WorkerMetrics, decode
from kvflow.streams.bridge.serving_class import tenant_of
from kvflow.streams.explain import read_decisions
from kvflow.supervisor import WorkerSpec

MODEL = "SmolLM2-135M-Instruct"


async def spec_metrics(settings, catalog, timeout_s: float = 60.0):
    """The first WorkerMetrics record with accepted draft tokens (None if none within ``timeout_s``)."""
    def accepted(value: bytes):
        rec = decode(MetricRecord, value)
        if isinstance(rec, WorkerMetrics) and rec.spec_decode and rec.spec_decode.accepted_tokens:
            return rec.spec_decode
        return None

    return await first_record(settings, catalog.metrics.name, catalog.metrics.partitions, accepted, timeout_s,
                              poll_ms=500)


async def test_headers_reach_the_decision_record_and_speculation_reaches_the_metrics(kafka, monkeypatch):
    settings, catalog = kafka
    monkeypatch.setenv("KVFLOW_MOCKER_SPEC_NUM_DRAFT_TOKENS", "4")  # the worker processes read the environment
    monkeypatch.setenv("KVFLOW_MOCKER_SPEC_ACCEPTANCE_RATE", "0.8")
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "20"])
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 64, "ignore_eos": True}
    headers = {"Authorization": "Bearer sk-tenant-a", "X-Priority": "3", "X-Session-Id": "chat-1"}
    async with running_deployment(settings, spec, workers=1) as sup:
        async with httpx.AsyncClient(base_url=sup.url, timeout=120) as http:
            resp = await http.post("/v1/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 64
        request_id = resp.json()["id"]
        records: list = []
        for _ in range(40):  # decision records are sent without waiting for the broker's ack
            records = await read_decisions(settings, request_id, catalog, idle_ms=300)
            if records:
                break
        assert records and records[-1].priority == 3 and records[-1].tenant == tenant_of("sk-tenant-a")
        counters = await spec_metrics(settings, catalog)
    assert counters is not None and counters.mean_accepted_length > 1
