#!/usr/bin/env bash
# Session 5, third device call (branch s5 + the final round's partly-timed margin): the RMSNorm
# tests that calls 1-2 did not reach (test_tuned passed in call 2); then, alone on the GPU, the
# skinny matmul rows (split-K's search time leaves out its sum kernel: the final round now also
# times the fastest whole config), and the D64 forward rows (plain vs pipelined forward).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call3.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 200 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 \
   tests/gpu/test_rms_norm.py -k "not test_tuned" >"$OUT/t_rms.log" 2>&1; echo "rc=$?" >>"$OUT/t_rms.log"
grep -E "passed|failed|rc=|^E |^FAILED" "$OUT/t_rms.log" | tail -8 | cut -c1-250
TILETUNE_LOG=1 timeout -s INT 120 python3 -m tiletune bench matmul --match "16x4096x4096" --match "128x4096x4096" \
   --match "512x4096x4096" --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_mm.log" | cut -c1-600
grep -A1 "^INFO:tiletune:tuned" "$OUT/bench_mm.log" | cut -c1-700
TILETUNE_LOG=1 timeout -s INT 150 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "D64 bf16 fwd$" --match "D64 bf16 causal fwd$" \
   --json "$OUT/bench_fmha_d64.json" >"$OUT/bench_fmha_d64.log" 2>&1
grep -E "^\{|final round|failed" "$OUT/bench_fmha_d64.log" | cut -c1-700
