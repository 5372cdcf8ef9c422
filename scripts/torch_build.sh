#!/usr/bin/env bash
# Which torch build scripts/setup.sh installs: the CPU build or the CUDA build, and why.
#
#   TORCH_BUILD=cpu|cuda   chooses; unset (or auto): cuda when `nvidia-smi -L` lists a GPU, else cpu
#
# Linux CPU: torch==2.13.0+cpu, the PyTorch CPU wheel (https://download.pytorch.org/whl/cpu):
# about 200 MB, where PyPI's torch==2.13.0 for Linux bundles CUDA libraries of several GB.
# CUDA: torch==2.13.0 from PyPI (its Linux wheel is the CUDA build). macOS: torch==2.13.0 (PyPI's
# macOS wheels are CPU builds; there is no CUDA build for macOS).
#
# setup.sh sources this file and calls torch_choice. Run directly it installs nothing and needs
# no network: it prints the build, the pip requirement and the reason, one per line, e.g.
#   cpu
#   torch==2.13.0+cpu
#   no NVIDIA GPU: nvidia-smi is not on PATH
# It exits 2 when TORCH_BUILD names no build. Bash 3.2 (macOS) and later.

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# Sets TORCH_CHOICE (cpu|cuda), TORCH_REQUIREMENT (what to pip install) and TORCH_REASON.
torch_choice() {
  local build="${TORCH_BUILD:-auto}" gpus line count=0 first=""
  case "$build" in
    cpu|cuda)
      TORCH_CHOICE=$build
      TORCH_REASON="TORCH_BUILD=$build"
      ;;
    auto)
      if ! command -v nvidia-smi >/dev/null 2>&1; then
        TORCH_CHOICE=cpu
        TORCH_REASON="no NVIDIA GPU: nvidia-smi is not on PATH"
      elif gpus=$(nvidia-smi -L 2>/dev/null); then
        while IFS= read -r line; do
          case "$line" in
            "GPU "*) count=$((count + 1)); [ -n "$first" ] || first=$line ;;
          esac
        done <<EOF
$gpus
EOF
        if [ "$count" -gt 0 ]; then
          TORCH_CHOICE=cuda
          TORCH_REASON="nvidia-smi lists $count GPU(s): ${first%% (UUID*}"
        else
          TORCH_CHOICE=cpu
          TORCH_REASON="no NVIDIA GPU: nvidia-smi -L lists none"
        fi
      else
        TORCH_CHOICE=cpu
        TORCH_REASON="no NVIDIA GPU: nvidia-smi -L failed (no driver or no device)"
      fi
      ;;
    *)
      echo "TORCH_BUILD=$build: expected cpu, cuda or auto (unset: auto)" >&2
      return 2
      ;;
  esac
  case "$(uname -s)" in
    Linux)
      if [ "$TORCH_CHOICE" = cpu ]; then
        TORCH_REQUIREMENT="torch==${TORCH_VERSION}+cpu"
      else
        TORCH_REQUIREMENT="torch==${TORCH_VERSION}"
      fi
      ;;
    Darwin)
      if [ "$TORCH_CHOICE" = cuda ]; then
        echo "TORCH_BUILD=cuda: PyTorch has no CUDA build for macOS; use TORCH_BUILD=cpu" >&2
        return 2
      fi
      TORCH_REQUIREMENT="torch==${TORCH_VERSION}"
      ;;
    *)
      TORCH_REQUIREMENT="torch==${TORCH_VERSION}"
      ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  torch_choice
  printf '%s\n' "$TORCH_CHOICE" "$TORCH_REQUIREMENT" "$TORCH_REASON"
fi
