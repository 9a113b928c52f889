"""The pure stream follower (kvflow.streams.follow) and the deadline formula (kvflow.streams.deadlines).

A record sequence with a migration in the middle is followed live (the
follower asks for the resubmission) and replayed (it follows the next
attempt's records its earlier reader caused): both give the same stream.
"""

from __future__ import annotations

import pytest

from kvflow.schemas import (
    DEADLINE_EXCEEDED,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    ReplyTo,
    SamplingParams,
    TokenDelta,
    Usage,
)
from kvflow.settings import Settings
from kvflow.streams.deadlines import default_timeout_s, request_timeout_s
from kvflow.streams.follow import Emit, Follower, Resubmit

REQUEST = InferenceRequest(request_id="r1", model="m", token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=6),
                           reply_to=ReplyTo(topic="responses", partition=0))
LOST = ErrorInfo(message="worker lost", type="service_unavailable", code="worker_lost", status=503)


def delta(index: int, ids: list[int], attempt: int = 0) -> TokenDelta:
    return TokenDelta(request_id="r1", index=index, token_ids=ids, text="".join(chr(96 + i) for i in ids),
                      attempt=attempt)


def final(ids: list[int], attempt: int = 0, error: ErrorInfo | None = None) -> FinalResponse:
    return FinalResponse(request_id="r1", token_ids=ids, text="".join(chr(96 + i) for i in ids), attempt=attempt,
                         finish_reason=FinishReason.error if error else FinishReason.length, error=error,
                         usage=Usage(prompt_tokens=3 + 2 * attempt, completion_tokens=len(ids)))


# attempt 0 delivers two tokens and loses its worker; attempt 1 finishes; attempt 0's worker, thought
# lost, still sends a delta after the resubmission.
RECORDS = [delta(0, [1]), delta(1, [2]), final([], error=LOST), delta(2, [9]), delta(0, [3, 4], attempt=1),
           delta(1, [5, 6], attempt=1), final([3, 4, 5, 6], attempt=1)]


def follow(follower: Follower, records) -> tuple[list, list]:
    out, resubmitted = [], []
    for record in records:
        step = follower.feed(record)
        if isinstance(step, Resubmit):
            resubmitted.append(step.request)
        elif isinstance(step, Emit):
            out.append(step.event)
    return out, resubmitted


def test_live_follower_resubmits_and_gives_one_stream():
    out, resubmitted = follow(Follower(REQUEST, max_migrations=3), RECORDS)
    (nxt,) = resubmitted
    assert nxt.attempt == 1 and nxt.token_ids == [1, 2, 3, 1, 2] and nxt.resumed_tokens == 2
    assert nxt.sampling.max_tokens == 4 and nxt.deadline_ms == REQUEST.deadline_ms
    assert [d.index for d in out[:-1]] == [0, 1, 2, 3]
    assert [t for d in out[:-1] for t in d.token_ids] == [1, 2, 3, 4, 5, 6]
    end = out[-1]
    assert end.token_ids == [1, 2, 3, 4, 5, 6] and end.text == "abcdef"
    assert end.usage.prompt_tokens == 3 and end.usage.completion_tokens == 6


def test_replay_follows_the_next_attempt_its_reader_caused_and_matches_the_live_stream():
    live, _ = follow(Follower(REQUEST, max_migrations=3), RECORDS)
    replayed, resubmitted = follow(Follower(REQUEST, max_migrations=3, migrate=False), RECORDS)
    assert not resubmitted
    assert replayed == live


def test_replay_releases_a_migratable_final_nobody_followed_up():
    follower = Follower(REQUEST, max_migrations=3, migrate=False)
    out, _ = follow(follower, RECORDS[:3])
    assert len(out) == 2 and follower.held is not None
    end = follower.release()
    assert end.error.code == "worker_lost" and follower.release() is None


def test_no_migration_past_the_limit_or_without_prompt_ids():
    out, resubmitted = follow(Follower(REQUEST, max_migrations=0), RECORDS[:3])
    assert not resubmitted and out[-1].error.code == "worker_lost"
    no_ids = REQUEST.model_copy(update={"token_ids": None, "prompt": "hi"})
    out, resubmitted = follow(Follower(no_ids, max_migrations=3), RECORDS[:3])
    assert not resubmitted and out[-1].error.code == "worker_lost"


def test_deadline_final_carries_the_output_delivered():
    follower = Follower(REQUEST, max_migrations=3)
    follow(follower, RECORDS[:2])
    end = follower.deadline_final("too late")
    assert end.finish_reason is FinishReason.error and end.error.code == DEADLINE_EXCEEDED
    assert end.error.status == 504 and end.token_ids == [1, 2] and end.text == "ab"
    assert end.usage.completion_tokens == 2 and end.usage.prompt_tokens == 3


def test_default_timeout_is_a_ttft_allowance_plus_a_per_token_allowance():
    settings = Settings()
    assert default_timeout_s(settings, 256) == pytest.approx(120 + 256 * 0.2)
    assert default_timeout_s(Settings(deadline_ttft_s=10, deadline_per_token_ms=50), 100) == pytest.approx(15)
    assert default_timeout_s(Settings(request_deadline_s=30), 100_000) == 30
    assert default_timeout_s(settings, 1_000_000) == 86400  # capped at a day


def test_requested_timeouts_take_the_smallest_and_are_bounded():
    settings = Settings()
    assert request_timeout_s(settings, 256, None, None) == default_timeout_s(settings, 256)
    assert request_timeout_s(settings, 256, 30.0, None) == 30.0
    assert request_timeout_s(settings, 256, 30.0, 5.0) == 5.0
    with pytest.raises(ValueError):
        request_timeout_s(settings, 256, 0.0)
    with pytest.raises(ValueError):
        request_timeout_s(settings, 256, 90000.0)
