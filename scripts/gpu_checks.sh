#!/usr/bin/env bash
# Everything that needs the GPU, in one batch (the H200 machine: no network, bundle in .gpu/):
#   source .gpu/install.sh && bash scripts/gpu_checks.sh [OUT_DIR]
# Runs tests/gpu (kernels vs the torch oracle, both backends), the kernel benchmark, the one-layer benchmark and the
# 20-step pretrain example for both backends. Each step has its own log and time limit; a failing step does not
# stop the others. Logs land in OUT_DIR (default: $OUT or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "[gpu_checks] $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$OUT_DIR/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv > "$OUT_DIR/gpu.txt" 2>&1
step tests_gpu 420 python -m pytest tests/gpu -q -s -p no:cacheprovider
[ -f scripts/bench/bench_dsa_kernels.py ] && step bench_kernels 420 python scripts/bench/bench_dsa_kernels.py --out "$OUT_DIR/kernels.md"
step bench_layer 300 python scripts/bench/bench_glm5_layer.py --out "$OUT_DIR/layer.md"
step pretrain_megatron 300 bash examples/pretrain_glm5_tiny.sh megatron
step pretrain_tilelang 300 bash examples/pretrain_glm5_tiny.sh tilelang
