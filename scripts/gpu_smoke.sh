#!/usr/bin/env bash
# GPU smoke check on one machine with CUDA, one NCCL rank per GPU (see scripts/gpu_smoke.py):
#   1. the bound path: ensure_distributed_initialized(), default strategy, check, a DTensor op;
#   2. the CLI path: `torchrun -m shardcore check`, which joins an unbound NCCL world.
# Usage: scripts/gpu_smoke.sh [number of GPUs, default: all that nvidia-smi lists]
set -euo pipefail
cd "$(dirname "$0")/.."
gpus="${1:-$(nvidia-smi -L | wc -l)}"
half=$((gpus / 2))
if [ "$gpus" -gt 1 ]; then spec="tp=$half,role=train+tp=1,dp=$((gpus - half)),role=decode"; else spec="tp=1"; fi
torchrun --standalone --nproc-per-node "$gpus" scripts/gpu_smoke.py
torchrun --standalone --nproc-per-node "$gpus" -m shardcore check --shards "$spec"
