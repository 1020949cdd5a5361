#!/usr/bin/env bash
# The test suite: installs what it needs, then runs pytest (CPU only, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
# Two worker processes (pytest-xdist): most tests run tiny models on one thread, so one
# process left a core idle; SmolLM2 tests get one thread per worker (tests/conftest.py).
# Pass -n 0 to run in one process.
exec .venv/bin/python -m pytest -q -n 2 "$@"
