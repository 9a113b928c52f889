"""Prometheus metrics of a whole deployment (as `kvflow up` runs it), scraped at its one scrape point:
bridge, router and consumer-lag series of the supervisor's process merged with each worker process's."""

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.supervisor import WorkerSpec
from deployment import running_deployment

MODEL = "mock-metrics"
SPEC = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "20", "--num-kv-blocks", "2048",
                                                             "--block-size", "16"])


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of one exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(scrape: dict, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= set(ls))


@pytest.fixture
async def deployment(kafka):
    settings, catalog = kafka
    settings = settings.model_copy(update={"metrics_port": 0, "routing_policy": "kv"})
    async with running_deployment(settings, SPEC, workers=2) as sup:
        yield sup


async def scrape(http: httpx.AsyncClient, url: str) -> dict:
    answer = await http.get(url)
    assert answer.status_code == 200
    return samples(answer.text)


async def test_one_scrape_point_shows_every_process_moving(deployment):
    sup = deployment
    assert sup.metrics_url and len(sup.worker_metrics_urls()) == 2
    prompt = "the same long system prompt shared by every request " * 8
    async with httpx.AsyncClient(timeout=60) as http:
        before = await scrape(http, sup.metrics_url)

        async def ask(i: int) -> None:
            answer = await http.post(f"{sup.url}/v1/completions",
                                     json={"model": MODEL, "prompt": f"{prompt} question {i}", "max_tokens": 6})
            assert answer.status_code == 200, answer.text

        for batch in range(3):  # later batches find the shared prefix cached
            await asyncio.gather(*(ask(batch * 4 + i) for i in range(4)))
        after = await scrape(http, sup.metrics_url)

        # Workers: each process's series, labelled with its worker id, merged into one scrape.
        worker_ids = {dict(ls)["worker_id"] for (n, ls) in after if n == "kvflow_worker_info"}
        assert worker_ids == set(sup.children)
        assert total(after, "kvflow_worker_requests_total") - total(before, "kvflow_worker_requests_total") == 12
        assert total(after, "kvflow_worker_ttft_seconds_count") == 12
        assert total(after, "kvflow_worker_itl_seconds_count") > 0
        assert total(after, "kvflow_worker_generated_tokens_total") > total(before,
                                                                            "kvflow_worker_generated_tokens_total")
        assert total(after, "kvflow_worker_prefix_hit_tokens_total") > 0
        assert total(after, "kvflow_worker_kv_blocks_total") == 2 * 2048
        # Router: decisions per worker and policy, overlap, index size, KV-event lag.
        assert total(after, "kvflow_router_decisions_total", policy="kv", outcome="routed") == 12
        assert total(after, "kvflow_router_overlap_blocks_count") == 12
        assert total(after, "kvflow_router_overlap_blocks_sum") > 0
        assert total(after, "kvflow_router_index_blocks") > 0
        assert total(after, "kvflow_router_kv_event_apply_lag_seconds_count") > 0
        # Bridge, in the same process as the router.
        assert total(after, "kvflow_bridge_requests_total", status="200") == 12
        # Consumer lag (refreshed at most every 2 s): every worker slot's group has committed on its queue,
        # and the router's on the requests topic (Faust commits every few seconds).
        lag_groups: set[str] = set()
        for _ in range(300):
            lagging = await scrape(http, sup.metrics_url)
            lag_groups = {dict(ls)["group"] for (n, ls) in lagging if n == "kvflow_consumer_lag_records"}
            if sum(".worker.aggregated." in g for g in lag_groups) == 2 \
                    and f"{sup.settings.namespace}-router" in lag_groups:
                break
            await asyncio.sleep(0.2)
        assert sum(".worker.aggregated." in g for g in lag_groups) == 2, lag_groups
        assert f"{sup.settings.namespace}-router" in lag_groups

        # A worker's own /metrics answers with its series alone.
        own = await scrape(http, sup.worker_metrics_urls()[0])
        assert {dict(ls)["worker_id"] for (n, ls) in own if n == "kvflow_worker_info"} == \
            {next(w for w, c in sup.children.items() if c.metrics_url == sup.worker_metrics_urls()[0])}
