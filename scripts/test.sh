#!/usr/bin/env bash
# The test suite: installs what it needs, then runs pytest (CPU only, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python -m pytest -q "$@"
