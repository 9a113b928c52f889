"""Bearer API keys on the HTTP bridge: where keys come from, 401 answers,
the open probe routes, and the open mode's start-up warning."""

from __future__ import annotations

import logging

import pytest
from test_bridge_unit import MODEL, ScriptedSource, assert_openai_error, chat_body, client_for, make_state
from typer.testing import CliRunner

from kvflow.cli import app as cli_app
from kvflow.settings import Settings
from kvflow.streams.bridge import api_keys as api_keys_module
from kvflow.streams.bridge import build_app, build_app_for_state
from kvflow.streams.bridge.api_keys import configured_api_keys, key_matches, read_api_keys_file


def test_env_keys_are_comma_separated_and_kept_out_of_repr(monkeypatch):
    monkeypatch.setenv("KVFLOW_API_KEYS", " sk-one, sk-two,,")
    settings = Settings()
    assert settings.api_keys == ("sk-one", "sk-two")
    assert "sk-one" not in repr(settings)
    assert configured_api_keys(settings) == {"sk-one", "sk-two"}
    monkeypatch.delenv("KVFLOW_API_KEYS")
    assert configured_api_keys(Settings()) == frozenset()


def test_keys_file_adds_to_env_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# bridge keys\nsk-file-1\n\n  sk-file-2  \n")
    assert read_api_keys_file(path) == ["sk-file-1", "sk-file-2"]
    settings = Settings(api_keys="sk-env", api_keys_file=str(path))
    assert configured_api_keys(settings) == {"sk-env", "sk-file-1", "sk-file-2"}


def test_keys_file_without_keys_is_refused_before_serving(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        build_app(Settings(bootstrap_servers="127.0.0.1:1", api_keys_file=str(empty)))
    result = CliRunner().invoke(cli_app, ["up", "--api-keys-file", str(empty)], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "holds no key" in result.output


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = api_keys_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", spy)
    assert key_matches("sk-b", ["sk-a", "sk-b", "sk-c"])
    assert len(calls) == 3  # no early exit on the match
    assert not key_matches("sk-", ["sk-a"]) and not key_matches("", ["sk-a"])
    assert not key_matches("sk-\udcff", ["sk-a"])  # undecodable header bytes: no crash


def test_v1_routes_need_a_valid_bearer_key():
    source = ScriptedSource()
    with client_for(make_state(source, api_keys="sk-good,sk-other")) as c:
        for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "Basic c2stZ29vZA=="},
                        {"Authorization": "Bearer"}, {"Authorization": "sk-good"}):
            resp = c.post("/v1/chat/completions", json=chat_body(), headers=headers)
            err = assert_openai_error(resp, 401, "invalid_api_key")
            assert err["type"] == "invalid_request_error" and resp.headers["www-authenticate"] == "Bearer"
            assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers),
                                401, "invalid_api_key")
            assert_openai_error(c.get("/v1/models", headers=headers), 401, "invalid_api_key")
            assert_openai_error(c.get(f"/v1/models/{MODEL}", headers=headers), 401, "invalid_api_key")
        assert source.requests == []
        # The key is checked before the body: a bad body without a key is still a 401.
        assert_openai_error(c.post("/v1/chat/completions", content=b"{junk"), 401, "invalid_api_key")

        good = {"Authorization": "Bearer sk-other"}
        assert c.post("/v1/chat/completions", json=chat_body(), headers=good).status_code == 200
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=good).status_code == 200
        assert [m["id"] for m in c.get("/v1/models", headers=good).json()["data"]] == [MODEL]
        assert len(source.requests) == 2

        # Probes and scrapers need no key.
        assert c.get("/health").status_code == 200
        assert c.get("/live").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_no_keys_means_open_with_a_warning(caplog):
    source = ScriptedSource()
    state = make_state(source)
    assert state.api_keys == frozenset()
    with caplog.at_level(logging.WARNING, logger="kvflow.streams.bridge.api_keys"):
        app = build_app_for_state(state)
    assert any("no API keys configured" in r.getMessage() for r in caplog.records)
    with client_for(state) as c:
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        assert c.post("/v1/chat/completions", json=chat_body(),
                      headers={"Authorization": "Bearer anything"}).status_code == 200
    assert len(source.requests) == 2 and app is not None


def test_keyed_bridge_logs_no_open_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvflow.streams.bridge.api_keys"):
        build_app_for_state(make_state(api_keys="sk-1"))
    assert not caplog.records
