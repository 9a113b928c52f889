"""/v1/responses through the whole deployment on the real embedded broker
(bridge → router → mocker worker processes → bridge), with the `openai`
package as the client: plain and streamed answers, instructions,
previous_response_id chained through the responses-log topic, errors."""

from __future__ import annotations

import httpx
import openai
import pytest

from deployment import running_deployment
from kvflow.streams.bridge.responses_log import ResponsesLog
from kvflow.supervisor import WorkerSpec

MODEL = "mock-responses"
SPEC = WorkerSpec(engine="mocker", model=MODEL, extra_args=["--speedup-ratio", "20", "--num-kv-blocks", "2048",
                                                             "--block-size", "16"])


@pytest.fixture
async def deployment(kafka):
    settings, _ = kafka
    async with running_deployment(settings, SPEC, workers=1) as sup:
        yield sup


async def test_openai_sdk_responses_plain_streamed_and_chained(deployment, kafka):
    settings, catalog = kafka
    client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused")

    first = await client.responses.create(model=MODEL, input="Tell me about Kafka.", instructions="Be brief.",
                                          max_output_tokens=9, temperature=0)
    assert first.id.startswith("resp_") and first.object == "response" and first.model == MODEL
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 9 and len(first.output_text) == 9  # mocker: one character per token
    assert first.instructions == "Be brief."
    assert first.output[0].type == "message" and first.output[0].role == "assistant"

    stream = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "Again, please."}],
                                           previous_response_id=first.id, max_output_tokens=6, stream=True)
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert len(text) == 6 and done.output_text == text == events[-4].text
    assert done.previous_response_id == first.id
    # The chained prompt carries the first exchange (less its instructions) before the new input.
    assert done.usage.input_tokens > first.usage.input_tokens + len(first.output_text) - len("Be brief.")

    # Another bridge (empty cache) finds the stored conversation on the responses-log topic.
    stored = await ResponsesLog(settings, catalog).get(done.id)
    assert stored is not None
    assert [(m.role, m.content) for m in stored.messages] == [
        ("user", "Tell me about Kafka."), ("assistant", first.output_text),
        ("user", "Again, please."), ("assistant", text)]

    stopped = await client.responses.create(model=MODEL, input="hello", max_output_tokens=3, store=False)
    assert await ResponsesLog(settings, catalog).get(stopped.id) is None

    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


async def test_responses_errors_are_openai_shaped(deployment):
    async with httpx.AsyncClient(base_url=deployment.url, timeout=60) as http:
        cases = [({"model": MODEL}, 400, "input"),
                 ({"model": MODEL, "input": ""}, 400, "input"),
                 ({"model": MODEL, "input": []}, 400, "input"),
                 ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, 400, None),
                 ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, None),
                 ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
                 ({"model": MODEL, "input": "x", "max_output_tokens": 10**7}, 400, "max_output_tokens"),
                 ({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
                 ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
                 ({"model": "no-such-model", "input": "x"}, 404, "model"),
                 ({"model": MODEL, "input": "x", "previous_response_id": "resp_missing"}, 404,
                  "previous_response_id")]
        for body, status, param in cases:
            r = await http.post("/v1/responses", json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error", (body, error)
            if param is not None:
                assert error["param"] == param, (body, error)
        junk = await http.post("/v1/responses", content=b"[1,2", headers={"content-type": "application/json"})
        assert junk.status_code == 400
