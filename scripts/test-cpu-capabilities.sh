#!/usr/bin/env bash
# Run the numeric tests (tests/loss, tests/trainer; not the slow ones) once per ATen CPU capability
# this machine supports: `default` (no SIMD dispatch), `avx2`, and `avx512` where the CPU has it.
# A tolerance that only one CPU's kernels meet fails here, on any machine, not on a contributor's.
set -euo pipefail
cd "$(dirname "$0")/.."
caps=(default)
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
[[ " $flags " == *" avx2 "* ]] && caps+=(avx2)
[[ " $flags " == *" avx512f "* ]] && caps+=(avx512)
for cap in "${caps[@]}"; do
  echo "-- ATEN_CPU_CAPABILITY=${cap}"
  ATEN_CPU_CAPABILITY=$cap .venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow" \
    -n "${PYTEST_WORKERS:-2}" tests/loss tests/trainer "$@"
done
