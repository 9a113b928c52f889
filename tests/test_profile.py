"""Profiling the mocker: the sweep drives the real MockerCore and yields sensible curves."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from kvflow.planner.profile import (
    DecodeProfile,
    PrefillProfile,
    Profile,
    mocker_decode_point,
    mocker_prefill_point,
    run_profile,
)
from kvflow.workers.engines.mocker_core import MockerConfig, decode_time_ms, prefill_time_ms

ISLS = (128, 512, 2048, 8192)
CONCS = (1, 4, 16, 64, 256)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return run_profile("mocker", isls=ISLS, concurrencies=CONCS)


def _arr(grid) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)


def test_single_prompt_ttft_is_one_step_by_hand():
    cfg = MockerConfig(enable_prefix_caching=False)
    ttft, thr = mocker_prefill_point(cfg, 128, 1)
    # one step: prefill of 128 new tokens + the decode term of sampling the first token at 2/16384 blocks used
    expected = prefill_time_ms(cfg, 128) + decode_time_ms(cfg, 2 / 16384)
    assert ttft == pytest.approx(expected, rel=1e-9)
    assert thr == pytest.approx(128 * 1000 / expected, rel=1e-9)


def test_chunked_prompt_ttft_sums_its_steps():
    cfg = MockerConfig(enable_prefix_caching=False)
    ttft, _ = mocker_prefill_point(cfg, 16384, 1)
    # two full 8192-token chunks; only the second samples a token (256 blocks used)
    expected = 2 * prefill_time_ms(cfg, 8192) + decode_time_ms(cfg, 256 / 16384)
    assert ttft == pytest.approx(expected, rel=1e-9)


def test_decode_itl_matches_formula_at_measured_usage():
    cfg = MockerConfig(enable_prefix_caching=False)
    itl, thr, usage = mocker_decode_point(cfg, 1024, 16)
    # 16 sequences of ~1024+ tokens hold 17 blocks each once decoding starts
    assert usage == pytest.approx(16 * 17 / 16384, rel=0.1)
    assert itl == pytest.approx(decode_time_ms(cfg, usage), rel=0.01)
    assert thr == pytest.approx(16 * 1000 / itl)


def test_prefill_curves_are_monotone(profile: Profile):
    ttft = _arr(profile.prefill.ttft_ms)
    thr = _arr(profile.prefill.throughput_tokens_per_s)
    for j in range(len(CONCS)):  # longer prompts take longer at any batch size
        col = ttft[:, j][~np.isnan(ttft[:, j])]
        assert np.all(np.diff(col) > 0)
    for i in range(len(ISLS)):  # batching more prompts raises TTFT and never lowers throughput
        row_t, row_x = ttft[i][~np.isnan(ttft[i])], thr[i][~np.isnan(thr[i])]
        assert np.all(np.diff(row_t) > 0)
        assert np.all(np.diff(row_x) >= -1e-6)
    # throughput saturates near the token budget per step: 8192 tokens per ~170 ms step
    assert 40_000 < np.nanmax(thr) < 50_000


def test_decode_curves_are_monotone_and_capacity_bounded(profile: Profile):
    itl = _arr(profile.decode.itl_ms)
    thr = _arr(profile.decode.throughput_tokens_per_s)
    usage = _arr(profile.decode.kv_usage)
    for i in range(len(ISLS)):
        ok = ~np.isnan(itl[i])
        assert np.all(np.diff(itl[i][ok]) > 0)
        assert np.all(np.diff(thr[i][ok]) > 0)
    for j in range(len(CONCS)):
        ok = ~np.isnan(itl[:, j])
        assert np.all(np.diff(itl[ok, j]) > 0)
    assert np.nanmax(usage) <= 1.0
    # 256 sequences of 8192 tokens need 256*129 blocks > 16384: infeasible, so None
    assert profile.decode.itl_ms[ISLS.index(8192)][CONCS.index(256)] is None
    # the mocker's decode step is 5.74 ms at an empty cache and at most 34.01 ms at a full one
    assert 5.74 < np.nanmin(itl) and np.nanmax(itl) <= 34.01


def test_save_load_roundtrip(tmp_path):
    path = tmp_path / "sub" / "p.json"
    made = run_profile("mocker", isls=(128, 256), concurrencies=(1, 2), out_path=path)
    data = json.loads(path.read_text())
    assert data["engine"] == "mocker" and data["engine_config"]["block_size"] == 64
    assert data["prefill"]["isl"] == [128, 256]
    assert Profile.load(path) == made


def test_schema_rejects_bad_grids():
    with pytest.raises(ValidationError, match="strictly increasing"):
        PrefillProfile(isl=[256, 128], concurrency=[1], ttft_ms=[[1.0], [2.0]], throughput_tokens_per_s=[[1.0], [2.0]])
    with pytest.raises(ValidationError, match="grid"):
        DecodeProfile(context_length=[128], concurrency=[1, 2], itl_ms=[[1.0]], throughput_tokens_per_s=[[1.0, 2.0]],
                      kv_usage=[[0.1, 0.2]])


def test_real_engines_point_to_the_live_sweep():
    with pytest.raises(ValueError, match="engine_sweep.profile_engine"):
        run_profile("hf")
    with pytest.raises(ValueError, match="--engine vllm"):
        run_profile("vllm")
    with pytest.raises(ValueError, match="unknown engine"):
        run_profile("tgi")
