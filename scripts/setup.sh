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
