#!/usr/bin/env bash
# Session 5, sixth device call, main as it lands, alone on the GPU: the whole matmul bench (split-K
# and persistent 2-CTA clusters in the space), then the D128 forward+backward FMHA rows without
# TileGym (its rows were measured before; its first-call tuning is slow).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call6.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
TILETUNE_LOG=1 timeout -s INT 230 python3 -m tiletune bench matmul \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_mm.log" | cut -c1-600
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "H32 S4096 D128 bf16 fwd+bwd" --match "H32 S4096 D128 bf16 causal fwd+bwd" \
   --json "$OUT/bench_fmha.json" >"$OUT/bench_fmha.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_fmha.log" | cut -c1-700
