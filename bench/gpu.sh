#!/usr/bin/env bash
# The one script to run when a GPU is available: tests on CUDA, step throughput (eager/compile,
# SDPA/FlexAttention, vs HF), recompute memory and the largest preset that fits, in under 8
# minutes on one H200. Writes bench/results/gpu-<date>.json and a .md summary (or --out PATH).
# `--cpu-smoke` runs the same sections on the CPU with tiny shapes. Details: bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_check.py "$@"
