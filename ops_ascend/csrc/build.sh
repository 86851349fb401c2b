#!/usr/bin/env bash
# Build the Ascend C kernels of deepinfer.ops_ascend into ops_ascend/csrc/build/lib/libdeepinfer_ascend_ops.so
# with CANN's toolchain (ascendc.cmake / bisheng) against the .venv's torch and torch_npu.
#
# Run by `DEEPINFER_ACCELERATOR=ascend ./build.sh` when CANN is present (ASCEND_HOME_PATH set by CANN's
# set_env.sh). The SoC is read from the first NPU's name (torch_npu) unless SOC_VERSION is set, e.g.
# SOC_VERSION=Ascend910B3 or an Ascend950 variant. At run time deepinfer.ops_ascend loads the library and
# uses its sampling kernel only after a self-test against the reference sampler; see ops_ascend/native.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="$root/.venv/bin/python"

: "${ASCEND_HOME_PATH:?is not set: source the set_env.sh of CANN first}"
command -v cmake >/dev/null || { echo "ops_ascend/csrc/build.sh: cmake is required" >&2; exit 1; }

if [ -z "${SOC_VERSION:-}" ]; then
  SOC_VERSION="$("$py" -c 'import torch, torch_npu; print(torch.npu.get_device_name(0))')"
fi
torch_cmake="$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
torch_npu_path="$("$py" -c 'import os, torch_npu; print(os.path.dirname(torch_npu.__file__))')"
echo "ops_ascend/csrc/build.sh: building for $SOC_VERSION"

cmake -S "$here" -B "$here/build" -DCMAKE_BUILD_TYPE=Release -DSOC_VERSION="$SOC_VERSION" \
  -DCMAKE_PREFIX_PATH="$torch_cmake" -DTORCH_NPU_PATH="$torch_npu_path"
cmake --build "$here/build" -j "$(nproc)"
echo "ops_ascend/csrc/build.sh: built $here/build/lib/libdeepinfer_ascend_ops.so"
