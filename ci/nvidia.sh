#!/usr/bin/env bash
# NVIDIA GPU runner (SM80 / SM90 / SM100): the conformance suite for deepinfer.ops_cuda in bf16 and fp32 at
# small and DeepSeek-V3 shapes (MoE at the real 7168 / 2048 sizes) with a JUnit report in $REPORT_DIR, then
# the project tests on the GPU (tests/nvidia then run the Triton kernels compiled, bf16 included). The
# shared steps are in ci/conformance.sh; the performance check is bench/device_nvidia.py.
set -euo pipefail
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "ci/nvidia.sh: no NVIDIA GPU visible (nvidia-smi -L lists none); run this on a GPU runner" >&2
  exit 3
fi
nvidia-smi -L
export DEEPINFER_ACCELERATOR=nvidia
export DEEPINFER_CONFORMANCE_DTYPES="${DEEPINFER_CONFORMANCE_DTYPES:-bfloat16,float32}"
export DEEPINFER_CONFORMANCE_SHAPES=all
export DEEPINFER_CONFORMANCE_FULL=1
exec "$(dirname "${BASH_SOURCE[0]}")/conformance.sh" "$@"
