#!/usr/bin/env bash
# The CUDA path on a machine with one NVIDIA GPU: one call, under 8 minutes (scripts/gpu_check.py says what
# it does). Needs torch with CUDA and megatron-core importable there; writes to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not found"
exec timeout 470 python3 scripts/gpu_check.py --out "${OUT:-/tmp/poseidon-gpu-check}" "$@"
