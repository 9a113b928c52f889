"""What the tests that run the real vLLM engine share: whether they can run here,
and the settings that keep them small on a CPU.

Outside CI a machine without vLLM skips them; in CI (``CI=true``, as
``.ci/run`` runs) a missing or broken vLLM fails them instead, because CI
installs it (``bash scripts/install.sh --vllm``) and must run them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

TEST_KV_CACHE_GB = 0.25
"""KV cache per test engine, GiB: ~5,800 tokens of SmolLM2 in float32."""

WORKER_KV_CACHE_GB = 0.5
"""KV cache per test worker process, GiB: such a worker serves SmolLM2's whole
8,192-token context, which takes 0.35 GiB in float32 (the CPU default dtype)."""

TEST_MAX_MODEL_LEN = 2048
"""Longest sequence of a test engine (it must fit the KV cache at least once)."""


def vllm_unavailable_reason() -> str | None:
    """Why the real vLLM engine cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (bash scripts/install.sh --vllm)"
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - a broken install is reported as the reason
        return f"vllm does not import: {exc}"
    if not (current_platform.is_cuda_alike() or current_platform.is_cpu()):
        return f"vllm found no supported platform (device type {current_platform.device_type!r})"
    return None


def in_ci() -> bool:
    """True under CI (``CI=true``), where the vLLM tests must run."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require_vllm() -> None:
    """Skip the calling test or fixture when vLLM cannot run here; in CI, fail it.

    Raises:
        pytest.skip.Exception: vLLM unavailable, outside CI.
        pytest.fail.Exception: vLLM unavailable in CI.
    """
    reason = vllm_unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI runs the vLLM tests, but {reason}", pytrace=False)
    pytest.skip(reason)
