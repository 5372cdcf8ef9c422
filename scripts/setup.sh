#!/usr/bin/env bash
# Create .venv and install composer-replication.
#
#   bash scripts/setup.sh          # what `composer-replication train` (the CPU demo) needs: the
#                                  # `train` extra (TRL stack, DiLoCo outer loop, report)
#   bash scripts/setup.sh --all    # every extra: each backend's SDK, verl, Monarch, OpenEnv,
#                                  # reasoning-gym, the gpu extra and the dev tools; what the
#                                  # test suite needs (scripts/test.sh and .ci/run ask for it)
#   SETUP_ALL=1 bash scripts/setup.sh   # the same as --all
#   EXTRAS=train,modal bash scripts/setup.sh   # exactly these extras (FRAMEWORK_EXTRAS and
#                                  # GPU_EXTRA=1 add verl/monarch and Triton/Liger-Kernel)
#   EXTRAS=train,vllm bash scripts/setup.sh    # vLLM generation: CUDA only, never in --all
#
# torch goes first, pinned to 2.13.0 and chosen on purpose (scripts/torch_build.sh): the CPU
# build when no NVIDIA GPU is found, the CUDA build when `nvidia-smi -L` lists one;
# TORCH_BUILD=cpu|cuda chooses. The package's own `torch>=2.6,<2.14` is then already satisfied,
# so nothing later pulls another torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
ALL_EXTRAS=train,diloco,serverless,ray,modal,hf-jobs,sagemaker,k8s,tasks,openenv,report,dev
ALL_FRAMEWORK_EXTRAS=verl,monarch
SETUP_ALL=${SETUP_ALL:-0}
for arg in "$@"; do
  case "$arg" in
    --all) SETUP_ALL=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' scripts/setup.sh | sed '$d'; exit 0 ;;
    *) echo "scripts/setup.sh: unknown argument '$arg' (use --all for every extra, or none for the demo's)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ "$SETUP_ALL" = 1 ]; then
  EXTRAS=${EXTRAS:-$ALL_EXTRAS}
  FRAMEWORK_EXTRAS=${FRAMEWORK_EXTRAS-$ALL_FRAMEWORK_EXTRAS}
  GPU_EXTRA=${GPU_EXTRA:-1}
else
  EXTRAS=${EXTRAS:-train}
  FRAMEWORK_EXTRAS=${FRAMEWORK_EXTRAS-}
  GPU_EXTRA=${GPU_EXTRA:-0}
fi
# shellcheck source=scripts/torch_build.sh
. scripts/torch_build.sh
torch_choice
echo "torch: the ${TORCH_CHOICE} build, ${TORCH_REQUIREMENT} (${TORCH_REASON}; TORCH_BUILD=cpu|cuda chooses)"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip

# A torch already in .venv of the other build is removed first: `torch==2.13.0` (the CUDA
# requirement) is satisfied by 2.13.0+cpu, so pip would keep it.
if .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if ! .venv/bin/python -W ignore - "$TORCH_CHOICE" <<'PY'
import sys
import torch
has_cuda = torch.version.cuda is not None
sys.exit(0 if has_cuda == (sys.argv[1] == "cuda") else 1)
PY
  then
    echo "torch: replacing the installed build of the other kind"
    .venv/bin/python -m pip uninstall --quiet --yes torch
  fi
fi

# The CPU wheel comes from the PyTorch CPU index, added to pip's own sources when it answers;
# when it does not, pip's own sources (pip.conf, PIP_FIND_LINKS, a local wheel folder) must hold
# torch==2.13.0+cpu, and pip says so if they do not. The +cpu pin never admits a CUDA build.
INDEX_ARGS=()
case "$TORCH_REQUIREMENT" in
  *+cpu)
    if .venv/bin/python - "$TORCH_CPU_INDEX/torch/" <<'PY'
import sys
import urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=15).close()
except Exception:
    sys.exit(1)
PY
    then
      INDEX_ARGS=(--extra-index-url "$TORCH_CPU_INDEX")
    else
      echo "torch: $TORCH_CPU_INDEX does not answer; looking for $TORCH_REQUIREMENT in pip's own sources"
    fi
    ;;
esac
.venv/bin/python -m pip install --quiet "$TORCH_REQUIREMENT" ${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}
.venv/bin/python -W ignore - "$TORCH_CHOICE" <<'PY'
import sys
import torch
cuda = torch.version.cuda
print(f"torch: installed {torch.__version__} ({f'CUDA {cuda}' if cuda else 'CPU-only'} build)")
if sys.argv[1] == "cuda" and cuda is None:
    sys.exit(
        "torch: the CUDA build was asked for, but pip installed a CPU-only one: your pip "
        "configuration (an index or find-links) supplies it. Point pip at a source of the CUDA "
        "build (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu128) and run again."
    )
PY

.venv/bin/python -m pip install --quiet -e ".[${EXTRAS}]"
# The framework extras go in a second step, on top of what is already resolved: verl pins old
# tensordict/antlr versions, and resolving everything in one go sends pip's backtracking
# resolver searching for tens of minutes; on top of an installed set it takes seconds.
if [ -n "${FRAMEWORK_EXTRAS}" ]; then
  .venv/bin/python -m pip install --quiet -e ".[${FRAMEWORK_EXTRAS}]"
fi
# The gpu extra (Triton, Liger-Kernel): on the CPU the tests run our Triton kernels and Liger-Kernel's
# in Triton's interpreter. liger-kernel declares torch, so it goes in without dependencies (pip
# would otherwise swap the torch build chosen above); a CUDA torch already brings its triton.
if [ "$GPU_EXTRA" = 1 ]; then
  .venv/bin/python -c "import triton" >/dev/null 2>&1 \
    || .venv/bin/python -m pip install --quiet "triton>=3.2"
  .venv/bin/python -m pip install --quiet --no-deps "liger-kernel==0.8.5"
fi
extras="${EXTRAS}${FRAMEWORK_EXTRAS:+,${FRAMEWORK_EXTRAS}}$([ "$GPU_EXTRA" = 1 ] && echo ,gpu)"
echo "composer-replication installed in .venv (torch ${TORCH_CHOICE} build; extras: ${extras})"
[ "$SETUP_ALL" = 1 ] || echo "(every extra, as the tests need: bash scripts/setup.sh --all)"
