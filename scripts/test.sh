#!/usr/bin/env bash
# The test command of the README.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
# setup.sh installs vLLM, so its tests must run, not skip (KVOFFLOAD_REQUIRE_VLLM=0 lets them skip).
export KVOFFLOAD_REQUIRE_VLLM=${KVOFFLOAD_REQUIRE_VLLM-1}
exec python -m pytest -q "$@"
