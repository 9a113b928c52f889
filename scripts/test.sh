#!/usr/bin/env bash
# Install (if needed) and run the test suite. Extra args go to pytest.
# --vllm (first): also install vLLM (scripts/install.sh --vllm), so the vLLM tests run.
# KVFLOW_TEST_WORKERS: pytest-xdist processes (default 2; each test file runs in one of
# them, with its own embedded broker; 0 runs everything in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
INSTALL_ARGS=()
if [ "${1:-}" = "--vllm" ]; then
  INSTALL_ARGS+=(--vllm)
  shift
fi
bash scripts/install.sh "${INSTALL_ARGS[@]}"
# Optional: NVIDIA aiperf in its own venv, for tests/test_aiperf.py (skipped without it).
if [ "${KVFLOW_TEST_AIPERF:-0}" = "1" ] && [ -z "${KVFLOW_AIPERF:-}" ]; then
  if [ ! -x .venv-aiperf/bin/aiperf ]; then
    python3 -m venv .venv-aiperf && .venv-aiperf/bin/python -m pip install -q "aiperf==0.13.0" \
      || echo "aiperf install failed: tests/test_aiperf.py will skip"
  fi
  if [ -x .venv-aiperf/bin/aiperf ]; then export KVFLOW_AIPERF="$PWD/.venv-aiperf/bin/aiperf"; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKERS="${KVFLOW_TEST_WORKERS:-2}"
XDIST=()
# --no-loadscope-reorder: hand out files in collection order, where tests/conftest.py puts the
# slowest first (xdist's default order, most tests first, started them last).
if [ "$WORKERS" != "0" ]; then XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest -q -ra "${XDIST[@]}" "$@"
