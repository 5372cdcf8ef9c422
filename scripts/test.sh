#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite. Exits non-zero on any failure,
# including pytest's exit code 5 ("no tests were collected").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
