#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite on every core: pytest-xdist with
# `--dist loadgroup`, so the `heavy` end-to-end tests run one after another on one worker while the
# other workers take the rest. Exits non-zero on any failure, including pytest's exit code 5 ("no
# tests were collected").
#
# A failing test's reason is printed the moment it fails (tests/conftest.py), the per-test results
# go to test-results/junit.xml, and the slowest tests are listed at the end.
#   PYTEST_WORKERS=1 bash scripts/test.sh    # serial, e.g. to bisect an order dependence
#   bash scripts/test.sh tests/loss -x       # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p test-results
workers=${PYTEST_WORKERS:-auto}
parallel=()
if [ "$workers" != "1" ]; then
  parallel=(-n "$workers" --dist loadgroup)
fi
exec .venv/bin/python -m pytest -q -ra --durations=25 --junitxml=test-results/junit.xml \
  "${parallel[@]}" "$@"
