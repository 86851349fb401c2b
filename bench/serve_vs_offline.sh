#!/usr/bin/env bash
# Served vs offline output throughput at saturation (issue 14): 64 closed-loop streaming clients
# against `deepinfer serve` (engine core in its own process), alternating with the offline engine
# at the same batch on the same prompts; 3 reps each, medians; per-rep load average and CPU us per
# token of the bench client, the API front and the engine core. About 5 minutes on a quiet 2-core host (a rep >= 15 s).
# The engine's OpenMP policy (GOMP_SPINCOUNT=10000, deepinfer/threads.py) applies to both sides (the
# core sets it by default; exported here so the offline engine in the bench process runs with it too),
# unless the caller chose OMP_WAIT_POLICY or GOMP_SPINCOUNT.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${OMP_WAIT_POLICY:-}" ] && [ -z "${GOMP_SPINCOUNT:-}" ]; then export GOMP_SPINCOUNT=10000; fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-.venv/bin/python}" -m deepinfer.cli bench serve \
  --concurrency 64 --compare-offline --reps 3 --num-requests 384 --input-len-range 64 512 --output-len 64 \
  --out "${OUT:-bench/results/serve_vs_offline.json}" "$@"
