#!/usr/bin/env bash
# Set up .venv (idempotent) and run the test suite on every core: pytest-xdist with
# `--dist loadgroup`. Exits non-zero on any failure, including pytest's exit code 5 ("no tests
# were collected").
#
#   bash scripts/test.sh           # the suite without the `long` end-to-end tests (~10 min, 2 cores)
#   bash scripts/test.sh --long    # only the `long` ones: whole training runs in several processes
#                                  # (the `heavy` among them one after another on one worker, the
#                                  # others beside them); CI runs it as a step of its own
#   bash scripts/test.sh --all     # both in one run
#   PYTEST_WORKERS=1 bash scripts/test.sh    # serial, e.g. to bisect an order dependence
#   bash scripts/test.sh --all tests/run -x  # extra arguments go to pytest (with --all, every
#                                            # test they name runs, long or not)
#
# A failing test's reason is printed the moment it fails (tests/conftest.py), the per-test results
# go to test-results/junit*.xml, and the slowest tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
select=(-m "not long")
junit=test-results/junit.xml
case "${1:-}" in
  --long) select=(-m long); junit=test-results/junit-long.xml; shift ;;
  --all) select=(); shift ;;
esac
bash scripts/setup.sh --all   # the suite needs every extra
mkdir -p test-results
workers=${PYTEST_WORKERS:-auto}
parallel=()
if [ "$workers" != "1" ]; then
  parallel=(-n "$workers" --dist loadgroup)
fi
exec .venv/bin/python -m pytest -q -ra --durations=25 --junitxml="$junit" \
  "${parallel[@]}" "${select[@]}" "$@"
