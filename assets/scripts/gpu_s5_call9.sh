#!/usr/bin/env bash
# Session 5, ninth device call (call 8 ran tests/gpu/test_fmha.py whole on main with heavy-first:
# 24 passed, 9 skipped): forward key tiles of 256 (64x256 with 4 or 8 warps; 128x256 at D64).
# Every forward config at D128 and D64 first, then, alone on the GPU, the four forward rows.
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call9.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 150 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 tests/gpu/test_fmha.py \
   -k "every_config and fmha_fwd" >"$OUT/t_fmha.log" 2>&1; echo "rc=$?" >>"$OUT/t_fmha.log"
grep -E "passed|failed|rc=|^E |^FAILED|s call" "$OUT/t_fmha.log" | tail -6 | cut -c1-250
grep -q "failed" "$OUT/t_fmha.log" && exit 1
TILETUNE_LOG=1 timeout -s INT 230 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "H32 S4096 D128 bf16 fwd$" --match "H32 S4096 D128 bf16 causal fwd$" \
   --match "D64 bf16 fwd$" --match "D64 bf16 causal fwd$" \
   --json "$OUT/bench_fmha_fwd.json" >"$OUT/bench_fmha_fwd.log" 2>&1
grep -E "^\{|final round|failed" "$OUT/bench_fmha_fwd.log" | cut -c1-900
