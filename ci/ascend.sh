#!/usr/bin/env bash
# Ascend NPU runner (950PR / 950DT, A2 / A3): needs CANN's environment (set_env.sh) on the runner.
#
# 1. builds for ascend with CANN (torch_npu and the Ascend C kernels of ops_ascend/csrc);
# 2. reports the custom-op self-tests (a built kernel that fails its self-test fails the run);
# 3. runs the backend conformance suite on the NPU in bfloat16 at DeepSeek-V3 shapes (real hidden and
#    expert sizes), JUnit in $REPORT_DIR, then the project tests on the NPU, among them
#    tests/ascend/test_hardware_parity.py (engine greedy parity, NPU vs CPU) (ci/conformance.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${ASCEND_HOME_PATH:-}" ] && [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
export DEEPINFER_ACCELERATOR=ascend
export DEEPINFER_CONFORMANCE_DTYPES="${DEEPINFER_CONFORMANCE_DTYPES:-bfloat16}"
export DEEPINFER_CONFORMANCE_FULL=1
export REPORT_DIR="${REPORT_DIR:-reports}"
mkdir -p "$REPORT_DIR"
npu-smi info || true

./build.sh
echo "ci: Ascend C custom-op self-tests"
DEEPINFER_LOG_LEVEL=info .venv/bin/python -m deepinfer.ops_ascend.native 2>&1 | tee "$REPORT_DIR/ascend-custom-ops.txt"
exec ci/conformance.sh "$@"
