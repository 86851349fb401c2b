#!/usr/bin/env bash
# Build deepinfer for one accelerator:  DEEPINFER_ACCELERATOR=cpu|nvidia|ascend|auto ./build.sh
#
# Creates or updates .venv, installs the project (editable) with the extras for that accelerator,
# builds native kernels where the toolchain exists, and builds the default model if it is missing.
# Idempotent: with nothing changed, a second run only checks stamps and finishes in seconds.
# Environment: PYTHON (interpreter for the venv, default python3), DEEPINFER_TORCH_SPEC (pip spec
# for torch; default torch==2.13.0 on cpu, the local CPU wheel).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

say() { printf 'build.sh: %s\n' "$*"; }
die() { printf 'build.sh: error: %s\n' "$1" >&2; exit "${2:-1}"; }

ACCEL="${DEEPINFER_ACCELERATOR:-auto}"
PY="${PYTHON:-python3}"
VENV=.venv
STAMPS="$VENV/.deepinfer-stamps"

has_cann() { [ -n "${ASCEND_HOME_PATH:-}" ] || [ -n "${ASCEND_TOOLKIT_HOME:-}" ]; }
has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

case "$ACCEL" in
  cpu | nvidia | ascend) ;;
  auto)
    if has_cann; then ACCEL=ascend; elif has_nvidia_gpu; then ACCEL=nvidia; else ACCEL=cpu; fi
    say "accelerator auto -> $ACCEL"
    ;;
  *) die "unknown DEEPINFER_ACCELERATOR='$ACCEL'; choose one of: auto, cpu, nvidia, ascend" 2 ;;
esac

# Ascend stops before anything is installed: without CANN, torch_npu breaks `import torch`.
if [ "$ACCEL" = ascend ] && ! has_cann; then
  die "accelerator ascend needs CANN: ASCEND_HOME_PATH (or ASCEND_TOOLKIT_HOME) is not set.
  Install CANN and source its set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh), then rerun.
  Nothing was installed (torch_npu without CANN breaks 'import torch'); an existing .venv is unchanged and still works for cpu." 3
fi

# ---------------------------------------------------------------------------------------- venv
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PY --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
mkdir -p "$STAMPS"
VPY="$VENV/bin/python"
# pip's own progress, one line per package (a first run downloads torch and friends: several minutes).
pip_install() {
  if ! "$VPY" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | { grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed|ERROR)' || true; } \
    | sed -u 's/^/build.sh:   /'; then
    die "pip install $* failed; rerun that command by hand to see pip's whole output"
  fi
}

# --------------------------------------------------------------------------------- install
case "$ACCEL" in
  cpu) EXTRAS="test"; TORCH_SPEC="${DEEPINFER_TORCH_SPEC:-torch==2.13.0}" ;;
  nvidia) EXTRAS="test,nvidia"; TORCH_SPEC="${DEEPINFER_TORCH_SPEC:-torch>=2.6,<2.15}" ;;
  ascend) EXTRAS="test,ascend"; TORCH_SPEC="${DEEPINFER_TORCH_SPEC:-torch>=2.6,<2.15}" ;;
esac
want="$ACCEL|$EXTRAS|$TORCH_SPEC|$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$STAMPS/install" 2>/dev/null)" = "$want" ] && "$VPY" -c 'import deepinfer.backends.ops' 2>/dev/null; then
  say "python environment up to date ($ACCEL, extras: $EXTRAS)"
else
  say "installing the python environment ($ACCEL); the first run downloads packages and can take several minutes"
  say "installing $TORCH_SPEC"
  pip_install "$TORCH_SPEC"
  say "installing deepinfer (editable) with extras [$EXTRAS]"
  pip_install setuptools wheel
  pip_install --no-build-isolation -e ".[$EXTRAS]"
  "$VPY" -c 'import deepinfer.backends.ops' || die "the installed package does not import"
  rm -rf build ./*.egg-info
  echo "$want" >"$STAMPS/install"
fi

# --------------------------------------------------------------------------- native kernels
build_native() {  # $1 name, $2 source dir, $3 file glob, $4 toolchain check command, $5 missing message, $6 build cmd
  local name=$1 dir=$2 glob=$3 check=$4 missing=$5 cmd=$6
  local sources=""
  [ -d "$dir" ] && sources=$(find "$dir" -name "$glob" -not -path "*/build/*" | sort)
  if [ -z "$sources" ]; then
    say "$name: no native sources in $dir; nothing to build"
    return
  fi
  if ! eval "$check" >/dev/null 2>&1; then
    say "$name: skipped: $missing"
    return
  fi
  local digest
  digest=$(cat $sources | sha256sum | cut -c1-16)
  if [ "$(cat "$STAMPS/$name" 2>/dev/null)" = "$digest" ]; then
    say "$name: up to date"
    return
  fi
  say "$name: building"
  eval "$cmd"
  echo "$digest" >"$STAMPS/$name"
}

say "ops_cuda: Triton kernels, compiled by Triton on first use; no native sources to build"
build_native ops_ascend ops_ascend/csrc '*.cpp' \
  "has_cann" \
  "needs CANN (ASCEND_HOME_PATH from set_env.sh)" \
  "bash ops_ascend/csrc/build.sh"

# ---------------------------------------------------------------------------- accelerator
if [ "$ACCEL" = nvidia ] && ! has_nvidia_gpu; then
  say "no NVIDIA GPU found (nvidia-smi lists none): triton is installed, but DEEPINFER_ACCELERATOR=nvidia will refuse to run on this host"
fi

say "done: $ACCEL. Next: $VENV/bin/python -m deepinfer.run \"def fibonacci(n):\""
