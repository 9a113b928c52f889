"""Schema round-trips through the wire format, and rejection of bad records."""

import pytest

from kvflow.schemas import (
    BlockRemoved,
    BlockStored,
    ChatMessage,
    DeadLetter,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    KvEventBatch,
    RecordError,
    ReplyTo,
    RequestMetrics,
    ResponseEvent,
    ScalingCommand,
    TokenDelta,
    Usage,
    WorkerHeartbeat,
    WorkerMetrics,
    WorkerRole,
    decode,
    encode,
)
from kvflow.schemas.metrics import MetricRecord

REPLY = ReplyTo(topic="kvflow.responses", partition=3)

RECORDS = [
    InferenceRequest(request_id="r1", model="m", messages=[ChatMessage(role="user", content="héllo")],
                     token_ids=[1, 2, 3], reply_to=REPLY, deadline_ms=123, priority=2),
    WorkerHeartbeat(worker_id="w", role=WorkerRole.decode, model="m", engine="mocker", block_size=16,
                    kv_total_blocks=10, queue_topic="q", queue_partition=1, ts_ms=5),
    KvEventBatch(worker_id="w", event_id=7, block_size=16, ts_ms=1,
                 events=[BlockStored(parent_block_hash=2**63 + 5, block_hashes=[2**64 - 1, 3]),
                         BlockRemoved(block_hashes=[3])]),
    ScalingCommand(decision_id="d", pool=WorkerRole.prefill, target_replicas=3, ts_ms=9),
    DeadLetter(source_topic="x", partition=0, offset=4, value="{", error="bad", consumer="c", ts_ms=1),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_round_trip(record):
    assert decode(type(record), encode(record)) == record


def test_response_union_discriminates():
    delta = TokenDelta(request_id="r", index=0, token_ids=[5], text="a")
    final = FinalResponse(request_id="r", finish_reason=FinishReason.error, usage=Usage(prompt_tokens=3),
                          error=ErrorInfo(message="x", status=503))
    assert decode(ResponseEvent, encode(delta)) == delta
    back = decode(ResponseEvent, encode(final))
    assert isinstance(back, FinalResponse) and back.error.status == 503


def test_metric_union():
    rm = RequestMetrics(ts_ms=1, request_id="r", model="m", worker_id="w", isl=3, osl=4, ttft_ms=1.5,
                        itl_ms=2.0, e2e_ms=9.0)
    wm = WorkerMetrics(ts_ms=1, worker_id="w", role="aggregated", active_requests=1, waiting_requests=0,
                       kv_used_blocks=1, kv_total_blocks=2)
    assert decode(MetricRecord, encode(rm)) == rm
    assert decode(MetricRecord, encode(wm)) == wm


def test_dead_letter_keeps_original_bytes_exactly():
    garbage, key = b"\xff\xfe\x00 junk \x9c", b"k\xc3"
    letter = DeadLetter.of(source_topic="t", partition=2, offset=9, key=key, value=garbage, error=ValueError("bad"),
                           consumer="c")
    back = decode(DeadLetter, encode(letter))
    assert back.original_value() == garbage and back.original_key() == key and back.error == "bad"
    assert back.value_b64 and "\ufffd" in back.value  # readable text alongside the exact bytes
    text = DeadLetter.of(source_topic="t", partition=0, offset=0, key=None, value=b'{"a": "\xc3\xa9"}', error="x",
                         consumer="c")
    assert text.value == '{"a": "\u00e9"}' and text.value_b64 is None and text.original_key() is None
    assert text.original_value() == b'{"a": "\xc3\xa9"}'
    assert DeadLetter.of(source_topic="t", partition=0, offset=0, key=None, value=None, error="x",
                         consumer="c").original_value() == b""
    # a letter written before value_b64 existed still reads
    assert DeadLetter(source_topic="x", partition=0, offset=4, value="{", error="bad", consumer="c",
                      ts_ms=1).original_value() == b"{"


@pytest.mark.parametrize("raw", [b"", b"not json", b'{"request_id": "r"}',
                                 b'{"request_id":"r","model":"m","reply_to":{"topic":"t","partition":0}}',
                                 b'{"request_id":"r","model":"m","prompt":"x","reply_to":{"topic":"t","partition":-1}}'])
def test_bad_records_raise_record_error(raw):
    with pytest.raises(RecordError):
        decode(InferenceRequest, raw)


def test_records_are_frozen_and_versioned():
    rec = RECORDS[0]
    assert rec.schema_version == 1
    with pytest.raises(Exception):
        rec.model = "other"


def test_unknown_fields_ignored_for_forward_compatibility():
    raw = encode(RECORDS[3])[:-1] + b',"added_in_v2":1}'
    assert decode(ScalingCommand, raw) == RECORDS[3]
