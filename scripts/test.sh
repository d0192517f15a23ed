#!/usr/bin/env bash
# The test command of the README.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
exec python -m pytest -q "$@"
