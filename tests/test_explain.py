"""``kvflow explain``: the router records every decision, and the command prints it.

The live test runs a deployment as ``kvflow up --engine mocker --workers 2
--policy kv`` does (the real embedded broker, the Supervisor's router and
two mocker worker processes), sends requests with a Kafka-native client, and
asks ``kvflow explain`` (through its typer app) how each was routed.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from deployment import running_deployment
from typer.testing import CliRunner

from kvflow.cli import app
from kvflow.deployments import DeploymentState, write_state
from kvflow.schemas import (
    CandidateCost,
    DecisionOutcome,
    DecisionRecord,
    FinishReason,
    SamplingParams,
    WorkerRole,
    decode,
    encode,
)
from kvflow.streams.client import KvflowClient
from kvflow.streams.explain import read_decisions, render_decision
from kvflow.supervisor import WorkerSpec

MODEL = "mock-explain"
TOKENS = list(range(1, 257))
"""A 256-token prompt (16 blocks of the mocker's 16 tokens)."""


def record(**kw) -> DecisionRecord:
    fields = dict(request_id="r1", model="m", outcome=DecisionOutcome.routed, policy="kv", router_id="router-1",
                  decided_ms=1_700_000_000_123, isl=320, worker_id="w1", candidates=[
                      CandidateCost(worker_id="w0", overlap_blocks=0, prefill_blocks=20.0,
                                    queued_prefill_blocks=4.0, decode_requests=2, load=2, cost=38.0),
                      CandidateCost(worker_id="w1", overlap_blocks=15, prefill_blocks=5.0,
                                    queued_prefill_blocks=0.0, decode_requests=0, load=0, cost=5.0),
                      CandidateCost(worker_id="w2", overlap_blocks=4, prefill_blocks=16.0,
                                    queued_prefill_blocks=0.0, decode_requests=0, load=0, cost=16.0)])
    fields.update(kw)
    return DecisionRecord(**fields)


def candidate_rows(text: str) -> list[list[str]]:
    """The cells of each candidate row (after the header) of a rendered decision, marker first."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("worker_id"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        marker = "*" if line[4] == "*" else ""
        rows.append([marker, *line[5:].split()])
    return rows


def test_record_is_compact_and_round_trips():
    rec = record()
    wire = encode(rec)
    assert decode(DecisionRecord, wire) == rec
    assert b"host_overlap_blocks" not in wire and b"prefill_worker_id" not in wire  # unset terms stay out
    assert len(wire) < 700


def test_render_sorts_candidates_by_cost_and_marks_the_chosen_one():
    text = render_decision(record())
    assert text.splitlines()[0] == "request r1: routed to w1"
    assert "policy kv" in text and "router router-1" in text and "ISL 320 tokens" in text
    header = next(line for line in text.splitlines() if "worker_id" in line).split()
    assert header == ["worker_id", "overlap", "prefill_blocks", "queued_prefill", "decode_reqs", "load", "cost"]
    rows = candidate_rows(text)
    assert [r[1] for r in rows] == ["w1", "w2", "w0"] and [r[0] for r in rows] == ["*", "", ""]
    assert rows[0][2:] == ["15", "5.00", "0.00", "0", "0", "5.00"]


def test_render_of_simple_policies_and_of_shed_requests():
    rr = record(policy="round_robin", worker_id="w0",
                candidates=[CandidateCost(worker_id="w0", load=3), CandidateCost(worker_id="w1", load=1)])
    text = render_decision(rr)
    assert next(line for line in text.splitlines() if "worker_id" in line).split() == ["worker_id", "load"]
    assert [r[:3] for r in candidate_rows(text)] == [["*", "w0", "3"], ["", "w1", "1"]]
    shed = render_decision(record(outcome=DecisionOutcome.shed, worker_id=None, candidates=[],
                                  reason="all workers are busy (kv)"))
    assert shed.splitlines()[0] == "request r1: shed" and "reason: all workers are busy (kv)" in shed


def test_explain_of_an_unknown_request_exits_1(kafka):
    settings, catalog = kafka
    result = CliRunner().invoke(app, ["explain", "no-such-request", "-b", settings.bootstrap_servers,
                                      "--namespace", settings.namespace])
    assert result.exit_code == 1
    assert "no routing decision recorded for request 'no-such-request'" in result.output
    assert catalog.routing_decisions.name in result.output


async def test_explain_prints_the_serving_worker_and_every_live_candidate(kafka, tmp_path):
    settings, catalog = kafka
    settings = settings.model_copy(update={"routing_policy": "kv"})
    spec = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "10"])
    async with running_deployment(settings, spec, 2, bridge=False, ready_timeout_s=180) as sup:
        live = sorted(sup.router.table.workers)
        assert len(live) == 2
        state_file = tmp_path / "deployment.json"
        write_state(state_file, DeploymentState(
            bootstrap_servers=settings.bootstrap_servers, embedded_broker=True, namespace=settings.namespace,
            url=sup.url, port=sup.port, bridge=False, pid=os.getpid(), routing_policy="kv"))
        async with KvflowClient(settings, catalog, timeout_s=120) as client:
            finals = []
            for _ in range(2):  # the same prompt twice: the second one finds its prefix cached
                final = await client.complete(client.new_request(
                    MODEL, token_ids=TOKENS, sampling=SamplingParams(max_tokens=4)))
                assert final.finish_reason is FinishReason.length, final
                finals.append(final)

        for final in finals:
            # Published without waiting for the ack: wait (generously) until the record is readable.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            records = await read_decisions(settings, final.request_id, catalog, idle_ms=500)
            while not records and loop.time() < deadline:
                records = await read_decisions(settings, final.request_id, catalog, idle_ms=500)
            assert len(records) == 1, records
            rec = records[0]
            assert rec.outcome is DecisionOutcome.routed and rec.worker_id == final.worker_id
            assert rec.policy == "kv" and rec.router_id == sup.router.router_id and rec.isl == len(TOKENS)
            assert rec.role is WorkerRole.aggregated and rec.model == MODEL
            assert sorted(c.worker_id for c in rec.candidates) == live
            chosen = next(c for c in rec.candidates if c.worker_id == final.worker_id)
            assert chosen.cost == pytest.approx(final.routing.cost) == min(c.cost for c in rec.candidates)
            assert chosen.overlap_blocks == final.routing.overlap_blocks
            assert rec.decided_ms == final.routing.decided_ms

            result = await asyncio.to_thread(CliRunner().invoke, app,
                                             ["explain", final.request_id, "--state-file", str(state_file)])
            assert result.exit_code == 0, result.output
            assert result.output.splitlines()[0] == f"request {final.request_id}: routed to {final.worker_id}"
            assert "policy kv" in result.output and f"router {sup.router.router_id}" in result.output
            rows = candidate_rows(result.output)
            assert sorted(r[1] for r in rows) == live  # one row per live worker
            assert [r[1] for r in rows if r[0] == "*"] == [final.worker_id]
            assert rows[0][1] == final.worker_id  # sorted by cost: the chosen (cheapest) first
