#!/usr/bin/env bash
# NVIDIA GPU runner (SM80 / SM90 / SM100): conformance in bf16 and fp32 at full DeepSeek-V3 sizes.
set -euo pipefail
export DEEPINFER_ACCELERATOR=nvidia
export DEEPINFER_CONFORMANCE_DTYPES="${DEEPINFER_CONFORMANCE_DTYPES:-bfloat16,float32}"
export DEEPINFER_CONFORMANCE_FULL=1
nvidia-smi -L
exec "$(dirname "${BASH_SOURCE[0]}")/conformance.sh" "$@"
