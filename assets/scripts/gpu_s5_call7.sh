#!/usr/bin/env bash
# Session 5, seventh device call: the causal forward's heavy-first query-tile order (a config
# dimension for causal keys). Correctness first (every forward config at D128 and D64, the
# heavy-first trials included; the AOT signature check; one tuned causal case), then, alone on
# the GPU, the causal forward rows, where the search and final round decide the order.
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call7.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 200 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 tests/gpu/test_fmha.py \
   -k "(every_config and fmha_fwd) or aot_signature or (tuned and 4097)" >"$OUT/t_fmha.log" 2>&1
echo "rc=$?" >>"$OUT/t_fmha.log"
grep -E "passed|failed|rc=|^E |^FAILED|s call" "$OUT/t_fmha.log" | tail -8 | cut -c1-250
grep -q "failed" "$OUT/t_fmha.log" && exit 1
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "H32 S4096 D128 bf16 causal fwd$" --match "H32/8 S4096 D128 bf16 causal fwd$" \
   --match "D64 bf16 causal fwd$" --json "$OUT/bench_fmha_causal.json" >"$OUT/bench_fmha_causal.log" 2>&1
grep -E "^\{|final round|failed" "$OUT/bench_fmha_causal.log" | cut -c1-900
