#!/usr/bin/env bash
# Ascend NPU runner (950PR / 950DT, A2 / A3): needs CANN's environment (set_env.sh) on the runner.
set -euo pipefail
if [ -z "${ASCEND_HOME_PATH:-}" ] && [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
export DEEPINFER_ACCELERATOR=ascend
export DEEPINFER_CONFORMANCE_DTYPES="${DEEPINFER_CONFORMANCE_DTYPES:-bfloat16}"
export DEEPINFER_CONFORMANCE_FULL=1
npu-smi info || true
exec "$(dirname "${BASH_SOURCE[0]}")/conformance.sh" "$@"
