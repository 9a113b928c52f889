"""Trace readers: every format, malformed input, options, and synthetic prompt tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvflow.replay.synth import PrefixHasher, hash_id_tokens, unique_tokens, word_hash_tokenize
from kvflow.replay.traces import TraceFormatError, detect_format, read_trace
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.schemas import InferenceRequest, ReplyTo, SamplingParams

TRACES = Path(__file__).resolve().parent.parent / "examples" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_first40min.jsonl"
AZURE = TRACES / "azure2023_conv.csv"
MTBENCH = TRACES / "mtbench_question.jsonl"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def mooncake_line(ts: float, isl: int, osl: int, hash_ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": isl, "output_length": osl, "hash_ids": hash_ids})


# ---- Mooncake -------------------------------------------------------------

def test_mooncake_example_file_parses_completely():
    trace = read_trace(MOONCAKE)
    raw = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    assert trace.format == "mooncake" and len(trace.requests) == len(raw) == 7851
    assert trace.hash_block_tokens == 512
    first = trace.requests[0]
    assert (first.arrival_ms, first.isl, first.osl, list(first.hash_ids)) == (
        raw[0]["timestamp"], raw[0]["input_length"], raw[0]["output_length"], raw[0]["hash_ids"])
    arrivals = [r.arrival_ms for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert np.mean([r.isl for r in trace.requests]) == pytest.approx(np.mean([r["input_length"] for r in raw]))


def test_mooncake_prompt_tokens_have_isl_length(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake_line(0, 1300, 5, [4, 5, 6])])
    req = read_trace(path).requests[0]
    tokens = req.prompt_token_ids()
    assert len(tokens) == 1300 and all(0 <= t < req.vocab_size for t in tokens)
    # The partial last block is the head of hash id 6's block.
    assert tokens[1024:] == hash_id_tokens([6], 512)[: 1300 - 1024]


@pytest.mark.parametrize(("line", "needle"), [
    ("{not json", "invalid JSON"),
    (json.dumps({"timestamp": 5, "input_length": 10, "output_length": 2}), "hash_ids"),
    (json.dumps({"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": [1]}), "timestamp"),
    (json.dumps({"timestamp": 5, "input_length": "10", "output_length": 2, "hash_ids": [1]}), "input_length"),
    (json.dumps({"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [1]}), "exceeds"),
    (json.dumps({"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [1]}), "output_length"),
    ('{"timestamp": 5, "input_length": NaN, "output_length": 2, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 5, "input_length": 1e400, "output_length": 2, "hash_ids": [1]}', "input_length"),
    ("[1, 2]", "JSON object"),
])
def test_mooncake_malformed_line_names_file_and_line(tmp_path, line, needle):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake_line(0, 10, 2, [1]), "", line])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path, fmt="mooncake")
    assert info.value.line == 3 and info.value.path == str(path)
    assert "bad.jsonl:3:" in str(info.value) and needle in str(info.value)
    assert isinstance(info.value, ValueError)


# ---- Azure ----------------------------------------------------------------

def test_azure_csv_timestamps_become_ms_from_first(tmp_path):
    path = tmp_path / "az.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                     b"2023-11-16 18:15:46.6805900,374,44\r\n"
                     b"2023-11-16 18:15:50.9951690,396,109\r\n"
                     b"2023-11-16 18:16:00.0000000,10,1\r\n")
    trace = read_trace(path)
    assert trace.format == "azure"
    # 18:15:50.995169 - 18:15:46.68059 = 4.314579 s; 18:16:00 - 18:15:46.68059 = 13.31941 s
    assert [r.arrival_ms for r in trace.requests] == pytest.approx([0.0, 4314.579, 13319.41])
    assert [(r.isl, r.osl) for r in trace.requests] == [(374, 44), (396, 109), (10, 1)]
    assert trace.requests[0].hash_ids is None and len(trace.requests[1].prompt_token_ids()) == 396


def test_azure_example_file_spans_58_minutes():
    trace = read_trace(AZURE)
    assert len(trace.requests) == 19366
    assert 57 * 60_000 < trace.duration_ms < 59 * 60_000


def test_azure_prompts_are_unique_and_seeded(tmp_path):
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,128,4\n"
                    "2023-11-16 18:15:47.68,128,4\n")
    a, b = read_trace(path, seed=1).requests
    ta, tb = a.prompt_token_ids(), b.prompt_token_ids()
    assert compute_block_hashes(ta, 16)[0] != compute_block_hashes(tb, 16)[0]
    assert ta == read_trace(path, seed=1).requests[0].prompt_token_ids()
    assert ta != read_trace(path, seed=2).requests[0].prompt_token_ids()


@pytest.mark.parametrize(("row", "needle"), [
    ("yesterday,10,5", "bad row"),
    ("2023-11-16 18:15:47.68,ten,5", "bad row"),
    ("2023-11-16 18:15:47.68,10,0", ">= 1"),
])
def test_azure_malformed_row_names_line(tmp_path, row, needle):
    path = tmp_path / "az.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\n{row}\n")
    with pytest.raises(TraceFormatError, match=rf"az\.csv:3: .*{needle}"):
        read_trace(path)


def test_azure_bad_header(tmp_path):
    path = write_lines(tmp_path / "az.csv", ["time,in,out", "1,2,3"])
    with pytest.raises(TraceFormatError, match=r"az\.csv:1: expected header"):
        read_trace(path)


# ---- text prompts ---------------------------------------------------------

def test_mtbench_uses_first_turn_and_default_osl():
    trace = read_trace(MTBENCH, rate=2.0)
    raw = [json.loads(line) for line in MTBENCH.read_text().splitlines() if line.strip()]
    assert trace.format == "prompts" and len(trace.requests) == 80
    by_index = {r.index: r for r in trace.requests}
    assert by_index[0].messages[0]["content"] == raw[0]["turns"][0]
    assert by_index[0].category == raw[0]["category"]
    assert all(r.osl == 256 for r in trace.requests)
    assert by_index[0].isl == len(word_hash_tokenize(raw[0]["turns"][0]))


def test_prompt_arrivals_are_poisson_at_the_given_rate(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": f"hello number {i}"}) for i in range(4000)])
    trace = read_trace(path, rate=5.0, seed=3)
    gaps = np.diff([r.arrival_ms for r in trace.requests])
    assert trace.requests[0].arrival_ms == 0.0
    assert gaps.mean() == pytest.approx(200.0, rel=0.06)  # 1 / 5 req/s
    assert np.std(gaps) == pytest.approx(200.0, rel=0.1)  # exponential: std == mean
    assert [r.arrival_ms for r in read_trace(path, rate=5.0, seed=3).requests] == [r.arrival_ms for r in trace.requests]
    assert read_trace(path, rate=5.0, seed=4).requests[1].arrival_ms != trace.requests[1].arrival_ms


def test_prompt_jsonl_with_max_tokens_and_custom_tokenizer(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "abcdef", "max_tokens": 7})])
    req = read_trace(path, tokenizer=lambda text: [ord(c) for c in text]).requests[0]
    assert (req.isl, req.osl) == (6, 7)
    assert req.prompt_token_ids(lambda text: [ord(c) for c in text]) == [97, 98, 99, 100, 101, 102]


def test_prompt_jsonl_malformed(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"turns": ["hi"]}), json.dumps({"turns": []})])
    with pytest.raises(TraceFormatError, match=r"p\.jsonl:2: field 'turns'"):
        read_trace(path)


def test_sharegpt(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "What is KV caching?"},
                           {"from": "gpt", "value": "It stores keys and values ."}]},
        {"conversations": []},  # skipped
        {"conversations": [{"from": "gpt", "value": "hello"}]},  # skipped: no human prompt
        {"conversations": [{"from": "human", "value": "Just a question"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    trace = read_trace(path, rate=1.0, osl=99)
    assert trace.format == "sharegpt" and [r.index for r in trace.requests] == [0, 3]
    first, last = trace.requests
    assert first.prompt_text() == "What is KV caching?" and first.isl == 5  # What is KV caching ?
    assert first.osl == 6  # It stores keys and values .
    assert last.osl == 99


def test_sharegpt_malformed(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[{"conversations": []},\n {"turns": 1}]')
    with pytest.raises(TraceFormatError, match="record 1"):
        read_trace(path)
    path.write_text('[{"conversations": [],\n oops]')
    with pytest.raises(TraceFormatError, match=r"sg\.json:2: invalid JSON"):
        read_trace(path)


def test_kvflow_request_log(tmp_path):
    reply = ReplyTo(topic="responses", partition=0)
    recs = [
        InferenceRequest(request_id="b", model="m", token_ids=[1, 2, 3], reply_to=reply, created_ms=1_700_000_000_500,
                         sampling=SamplingParams(max_tokens=9)),
        InferenceRequest(request_id="a", model="m", prompt="one two three four", reply_to=reply,
                         created_ms=1_700_000_000_000),
    ]
    path = write_lines(tmp_path / "log.jsonl", [r.model_dump_json() for r in recs])
    assert detect_format(path) == "kvflow"
    trace = read_trace(path)
    assert [(r.request_id, r.arrival_ms, r.isl, r.osl) for r in trace.requests] == [
        ("a", 0.0, 4, 256), ("b", 500.0, 3, 9)]
    assert trace.requests[1].prompt_token_ids() == [1, 2, 3]
    bad = write_lines(tmp_path / "bad.jsonl", [recs[0].model_dump_json(),
                                               json.dumps({"request_id": "x", "reply_to": {"topic": "r"}})])
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: not an InferenceRequest"):
        read_trace(bad)


def test_detect_format(tmp_path):
    assert detect_format(MOONCAKE) == "mooncake"
    assert detect_format(AZURE) == "azure"
    assert detect_format(MTBENCH) == "prompts"
    with pytest.raises(TraceFormatError, match="unknown trace suffix"):
        detect_format(write_lines(tmp_path / "t.txt", ["x"]))
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: unrecognised"):
        detect_format(write_lines(tmp_path / "t.jsonl", [json.dumps({"foo": 1})]))
    with pytest.raises(TraceFormatError, match="empty"):
        detect_format(write_lines(tmp_path / "e.jsonl", [""]))


# ---- options ----------------------------------------------------------------

def test_slicing_speedup_and_limit(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake_line(ts, 10, 2, [i]) for i, ts in
                                              enumerate([0, 1000, 2000, 3000, 4000, 5000])])
    sliced = read_trace(path, start_ms=1000, end_ms=4000)
    assert [(r.index, r.arrival_ms) for r in sliced.requests] == [(1, 0.0), (2, 1000.0), (3, 2000.0)]
    fast = read_trace(path, start_ms=1000, end_ms=4000, speedup=4.0)
    assert [r.arrival_ms for r in fast.requests] == [0.0, 250.0, 500.0]
    assert [r.index for r in read_trace(path, start_ms=2000, limit=2).requests] == [2, 3]
    assert len(read_trace(path, limit=0).requests) == 0
    assert [r.arrival_ms for r in read_trace(path, speedup=0.5).requests][:2] == [0.0, 2000.0]
    with pytest.raises(ValueError, match="speedup"):
        read_trace(path, speedup=0)
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "missing.jsonl")


def test_rate_override_retimes_a_timestamped_trace(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake_line(i * 10_000, 10, 2, [i]) for i in range(300)])
    trace = read_trace(path, rate=100.0)
    assert trace.requests[-1].arrival_ms < 300 * 10 * 2  # ~3 s at 100 req/s instead of 2990 s
    assert [r.index for r in trace.requests] == list(range(300))


# ---- synthetic tokens and block hashes ---------------------------------------

@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_equal_hash_ids_give_equal_block_hashes(tmp_path, block_size):
    path = write_lines(tmp_path / "t.jsonl", [
        mooncake_line(0, 3 * 512, 2, [7, 8, 9]),
        mooncake_line(1, 3 * 512, 2, [7, 8, 10]),
        mooncake_line(2, 700, 2, [7, 11]),
        mooncake_line(3, 1400, 2, [7, 11, 12]),
    ])
    a, b, c, d = (r.prompt_token_ids() for r in read_trace(path).requests)
    ha, hb, hc, hd = (compute_block_hashes(t, block_size) for t in (a, b, c, d))
    per_id = 512 // block_size
    assert ha[: 2 * per_id] == hb[: 2 * per_id]  # hash ids 7, 8 shared
    assert ha[2 * per_id] != hb[2 * per_id]  # 9 vs 10
    assert ha[0] == hc[0]
    assert hc == hd[: len(hc)]  # the partial block of id 11 is a prefix of the full one
    assert len(hc) == 700 // block_size


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_prefix_hasher_matches_hashing_the_tokens(block_size):
    hasher = PrefixHasher(block_size)
    for hash_ids, isl in (([3, 1, 4], 1536), ([3, 1, 5], 1100), ([9], 40), ([9], 511)):
        tokens = hash_id_tokens(hash_ids, isl)
        assert hasher.block_hashes(hash_ids, isl) == compute_block_hashes(tokens, block_size)
    with pytest.raises(ValueError):
        PrefixHasher(48)


def test_synthetic_tokens_depend_only_on_their_seed():
    assert hash_id_tokens([42], 512) == hash_id_tokens([1, 42], 1024)[512:]
    assert hash_id_tokens([42], 512) != hash_id_tokens([43], 512)
    assert unique_tokens(0, 5, 100) == unique_tokens(0, 5, 200)[:100]
    assert unique_tokens(0, 5, 100) != unique_tokens(0, 6, 100)
    toks = np.array(hash_id_tokens(list(range(50)), 50 * 512, vocab_size=1000))
    assert toks.min() >= 0 and toks.max() < 1000
    assert len(np.unique(toks)) > 990  # spread over the whole vocabulary
