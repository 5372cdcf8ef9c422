#!/usr/bin/env bash
# Create .venv and install composer-replication with the extras the tests need.
# torch is installed first and pinned to 2.13.0: that is the CPU wheel; an unpinned torch (or any
# package that asks for torch before it is present) pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-train,diloco,serverless,ray,modal,hf-jobs,sagemaker,k8s,tasks,openenv,report,dev}
FRAMEWORK_EXTRAS=${FRAMEWORK_EXTRAS-verl,monarch}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[${EXTRAS}]"
# The framework extras go in a second step, on top of what is already resolved: verl pins old
# tensordict/antlr versions, and resolving everything in one go sends pip's backtracking
# resolver searching for tens of minutes; on top of an installed set it takes seconds.
if [ -n "${FRAMEWORK_EXTRAS}" ]; then
  .venv/bin/python -m pip install --quiet -e ".[${FRAMEWORK_EXTRAS}]"
fi
echo "composer-replication installed in .venv (extras: ${EXTRAS},${FRAMEWORK_EXTRAS})"
