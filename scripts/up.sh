#!/usr/bin/env bash
# Install (first run only) and start kvflow on embedded defaults:
# embedded Kafka broker, router, one hf worker serving SmolLM2-135M-Instruct,
# and the OpenAI-compatible bridge at http://127.0.0.1:8000. Extra args go to `kvflow up`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/kvflow ] || bash scripts/install.sh
exec .venv/bin/kvflow up "$@"
