#!/usr/bin/env bash
# Shared body of the vendor CI runners: build for $DEEPINFER_ACCELERATOR, run the backend conformance
# suite with a JUnit report in $REPORT_DIR, then the project's tests on that accelerator.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${DEEPINFER_ACCELERATOR:?set DEEPINFER_ACCELERATOR}"
REPORT_DIR="${REPORT_DIR:-reports}"
mkdir -p "$REPORT_DIR"

./build.sh
echo "ci: conformance suite for $DEEPINFER_ACCELERATOR (dtypes ${DEEPINFER_CONFORMANCE_DTYPES:-float32,bfloat16})"
.venv/bin/python -m pytest -p no:cacheprovider --pyargs deepinfer.backends.testing \
  --junitxml="$REPORT_DIR/conformance-$DEEPINFER_ACCELERATOR.xml"
echo "ci: project tests"
DEEPINFER_TEST_ACCELERATOR="$DEEPINFER_ACCELERATOR" .venv/bin/python -m pytest -q \
  --junitxml="$REPORT_DIR/tests-$DEEPINFER_ACCELERATOR.xml" "$@"
