"""Input bounds of the HTTP bridge: every out-of-range or malformed field is a
400 naming the field, never a 5xx, and nothing reaches the pipeline.

The app runs over ``ScriptedSource`` (see ``test_bridge_unit``): these tests
check what the bridge accepts, not the pipeline behind it.
"""

from __future__ import annotations

import jinja2
import pytest
from test_bridge_unit import MODEL, ScriptedSource, assert_openai_error, chat_body, client_for, heartbeat, make_state

from kvflow.models.tokenizer import ByteTokenizer
from kvflow.schemas.openai import MAX_STOP_CHARS, ChatCompletionRequest, CompletionRequest
from kvflow.settings import Settings
from kvflow.streams.bridge.bounds import DEFAULT_MAX_TOKENS, output_budget
from kvflow.streams.bridge.errors import BridgeError
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.tokenizers import TokenizerCache

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def completion_body(**kw) -> dict:
    body = {"model": MODEL, "prompt": "Hello"}
    body.update(kw)
    return body


def body_for(path: str, **kw) -> dict:
    return chat_body(**kw) if path == CHAT else completion_body(**kw)


# (path, fields, param, code): each one bad field → 400 naming it.
BAD_FIELDS = [
    (COMPLETIONS, {"max_tokens": 99999999999999999999}, "max_tokens", None),
    (COMPLETIONS, {"max_tokens": 100_000}, "max_tokens", "invalid_value"),  # over Settings.max_output_tokens
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens", None),
    (COMPLETIONS, {"max_tokens": 5.5}, "max_tokens", None),
    (COMPLETIONS, {"max_tokens": "many"}, "max_tokens", None),
    (COMPLETIONS, {"max_tokens": [1]}, "max_tokens", None),
    (CHAT, {"max_completion_tokens": 2**70}, "max_completion_tokens", None),
    (CHAT, {"max_completion_tokens": 40_000, "max_tokens": 5}, "max_completion_tokens", "invalid_value"),
    (CHAT, {"n": 2}, "n", "unsupported"),
    (CHAT, {"n": 10**30}, "n", "unsupported"),
    (CHAT, {"n": 0}, "n", None),
    (COMPLETIONS, {"stop": [str(i) for i in range(17)]}, "stop", None),
    (COMPLETIONS, {"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", None),
    (CHAT, {"stop": ["ok", "y" * (MAX_STOP_CHARS + 1)]}, "stop", None),
    (CHAT, {"stop": [1, 2]}, "stop", None),
    (CHAT, {"stop": {"a": "b"}}, "stop", None),
    (COMPLETIONS, {"logprobs": 6}, "logprobs", None),
    (COMPLETIONS, {"logprobs": 2}, "logprobs", "unsupported"),
    (CHAT, {"top_logprobs": 21}, "top_logprobs", None),
    (CHAT, {"top_logprobs": 3}, "top_logprobs", "unsupported"),
    (CHAT, {"logprobs": {"nested": ["junk"]}}, "logprobs", None),
    (COMPLETIONS, {"best_of": 10**20}, "best_of", None),
    (CHAT, {"temperature": 2.5}, "temperature", None),
    (CHAT, {"temperature": -0.1}, "temperature", None),
    (CHAT, {"temperature": "hot"}, "temperature", None),
    (COMPLETIONS, {"top_p": 0}, "top_p", None),
    (COMPLETIONS, {"top_p": 1.01}, "top_p", None),
    (COMPLETIONS, {"seed": 2**64}, "seed", None),
    (COMPLETIONS, {"priority": 2**40}, "priority", None),
    (COMPLETIONS, {"prompt": [5, -1]}, "prompt.1", None),
    (COMPLETIONS, {"prompt": [5, 2**40]}, "prompt.1", None),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt", None),
    (CHAT, {"stream_options": {"include_usage": {"deep": [[1]]}}}, "stream_options.include_usage", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", None),
    (CHAT, {"messages": [{"role": "user", "content": [7]}]}, "messages.0.content.0", None),
    (CHAT, {"messages": []}, "messages", None),
    (CHAT, {"model": ""}, "model", None),
    (CHAT, {"model": 12}, "model", None),
]


@pytest.mark.parametrize("path,fields,param,code", BAD_FIELDS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{'-'.join(f)}-{i}" for i, (p, f, _, _) in enumerate(BAD_FIELDS)])
def test_each_bound_is_a_400_naming_its_field(path, fields, param, code):
    source = ScriptedSource()
    with client_for(make_state(source)) as c:
        err = assert_openai_error(c.post(path, json=body_for(path, **fields)), 400, code)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert source.requests == []


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny-model", "prompt": "hi", "temperature": NaN}',
    b'{"model": "tiny-model", "prompt": "hi", "max_tokens": Infinity}',
    b'{"model": "tiny-model", "prompt": "\\ud800"}',  # lone surrogate: no tokenizer can encode it
    b'{"model": "tiny-model", "prompt": "\xff\xfe"}',  # not UTF-8
    b"[" * 5000 + b"]" * 5000,  # nesting deeper than the parser allows
    b'{"model": "tiny-model", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # a 5000-digit integer
    b'{"model": "tiny-model", "prompt": "hi"} trailing',
], ids=["nan", "infinity", "lone-surrogate", "not-utf8", "deep-nesting", "huge-integer", "trailing-junk"])
def test_json_python_would_accept_or_choke_on_is_invalid_json(raw):
    source = ScriptedSource()
    with client_for(make_state(source)) as c:
        assert_openai_error(c.post(COMPLETIONS, content=raw), 400, "invalid_json")
    assert source.requests == []


def test_integral_float_for_an_int_field_is_accepted():
    source = ScriptedSource()
    with client_for(make_state(source)) as c:
        assert c.post(COMPLETIONS, json=completion_body(max_tokens=5.0)).status_code == 200
    assert source.requests[0].sampling.max_tokens == 5


def test_output_cap_must_fit_the_advertised_context_length():
    source = ScriptedSource()
    state = make_state(source, workers=[heartbeat("w1", context_length=64), heartbeat("w2", context_length=128)])
    prompt = "x" * 40  # 40 byte tokens: 24 left in the smallest live worker's context
    with client_for(state) as c:
        err = assert_openai_error(c.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=25)), 400,
                                  "context_length_exceeded")
        assert err["param"] == "max_tokens" and "64" in err["message"] and "at most 24" in err["message"]
        err = assert_openai_error(c.post(CHAT, json=chat_body(max_completion_tokens=60)), 400,
                                  "context_length_exceeded")
        assert err["param"] == "max_completion_tokens"
        err = assert_openai_error(c.post(COMPLETIONS, json=completion_body(prompt="y" * 64)), 400,
                                  "context_length_exceeded")
        assert err["param"] == "prompt"
        long_chat = chat_body(messages=[{"role": "user", "content": "z" * 64}])
        assert assert_openai_error(c.post(CHAT, json=long_chat), 400, "context_length_exceeded")["param"] == "messages"
        assert source.requests == []
        # An exact fit is served; without a cap the default shrinks to the room left.
        assert c.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=24)).status_code == 200
        assert c.post(COMPLETIONS, json=completion_body(prompt=prompt)).status_code == 200
    assert [r.sampling.max_tokens for r in source.requests] == [24, 24]


def test_without_an_advertised_context_only_the_configured_cap_applies():
    source = ScriptedSource()
    with client_for(make_state(source, max_output_tokens=1000)) as c:
        assert_openai_error(c.post(COMPLETIONS, json=completion_body(max_tokens=1001)), 400, "invalid_value")
        assert c.post(COMPLETIONS, json=completion_body(max_tokens=1000)).status_code == 200
        assert c.post(COMPLETIONS, json=completion_body()).status_code == 200
    assert [r.sampling.max_tokens for r in source.requests] == [1000, DEFAULT_MAX_TOKENS]


def test_configured_request_size_limit_is_413():
    source = ScriptedSource()
    state = make_state(source, max_request_bytes=2048)
    assert state.max_body_bytes == 2048
    with client_for(state) as c:
        assert_openai_error(c.post(COMPLETIONS, json=completion_body(prompt="p" * 2100)), 413, "payload_too_large")
        assert c.post(COMPLETIONS, json=completion_body(prompt="p" * 1000)).status_code == 200
    assert len(source.requests) == 1


class _StrictTemplateTokenizer(ByteTokenizer):
    """A tokenizer whose chat template refuses two user turns in a row, as
    many real templates do (``raise_exception`` in Jinja)."""

    def encode_chat(self, messages):
        roles = [m.role for m in messages]
        if any(a == b for a, b in zip(roles, roles[1:])):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        return super().encode_chat(messages)


def test_chat_template_rejection_is_a_400():
    source = ScriptedSource()
    state = BridgeState(settings=Settings(), source=source, registry=make_state().registry,
                        tokenizers=TokenizerCache(loader=lambda spec: _StrictTemplateTokenizer()))
    twice = chat_body(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with client_for(state) as c:
        err = assert_openai_error(c.post(CHAT, json=twice), 400)
        assert err["param"] == "messages" and "alternate" in err["message"]
        assert c.post(CHAT, json=chat_body()).status_code == 200
    assert len(source.requests) == 1


@pytest.mark.parametrize("fields,prompt_tokens,context,expected", [
    ({}, 10, None, DEFAULT_MAX_TOKENS),
    ({}, 10, 100, 90),
    ({}, 10, 10_000, DEFAULT_MAX_TOKENS),
    ({"max_tokens": 7}, 10, None, 7),
    ({"max_tokens": 90}, 10, 100, 90),
])
def test_output_budget(fields, prompt_tokens, context, expected):
    body = CompletionRequest(model=MODEL, prompt="x", **fields)
    assert output_budget(body, prompt_tokens, max_output_tokens=500, context_length=context,
                         prompt_param="prompt") == expected


def test_output_budget_default_respects_a_small_configured_cap():
    body = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert output_budget(body, 5, max_output_tokens=16, context_length=None, prompt_param="messages") == 16
    with pytest.raises(BridgeError) as exc:
        output_budget(body, 100, max_output_tokens=16, context_length=100, prompt_param="messages")
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "context_length_exceeded", "messages")


async def test_worker_heartbeat_advertises_its_engine_context_length():
    from kvflow.workers.engines.mocker import MockerEngine
    from kvflow.workers.worker import Worker, WorkerConfig

    engine = MockerEngine()
    worker = Worker(Settings(bootstrap_servers="127.0.0.1:1"), WorkerConfig(worker_id="w0", slot=0, model=MODEL),
                    engine)
    assert worker._heartbeat_record().context_length is None  # the mocker has no context limit
    engine.context_length = 8192
    hb = worker._heartbeat_record()
    assert hb.context_length == 8192
    registry = make_state(workers=[hb]).registry
    assert registry.context_length(MODEL) == 8192
