#!/usr/bin/env bash
# CPU runner: the reference backend, float32 and bfloat16.
set -euo pipefail
export DEEPINFER_ACCELERATOR=cpu
export DEEPINFER_CONFORMANCE_DTYPES="${DEEPINFER_CONFORMANCE_DTYPES:-float32,bfloat16}"
exec "$(dirname "${BASH_SOURCE[0]}")/conformance.sh" "$@"
