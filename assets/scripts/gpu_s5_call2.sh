#!/usr/bin/env bash
# Session 5, second device call (branch s5, same warm machine as call 1): the RMSNorm and fused
# test files that call 1's time limit cut; then, alone on the GPU, the GQA rows with TileGym side
# by side (issue #5's last row) and the matmul rows where split-K is in the space (M 16/128/512)
# plus 4096^3 (split-K not in its space; the persistent 2-CTA configs are).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call2.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
t() { local log=$1; shift
      timeout -s INT 170 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 "$@" \
         >"$OUT/$log" 2>&1; echo "rc=$?" >>"$OUT/$log"; }
t t_rms.log tests/gpu/test_rms_norm.py &
t t_fused.log tests/gpu/test_rms_norm_rope.py &
wait
for f in t_rms t_fused; do echo "== $f"; grep -E "passed|failed|rc=|^E |^FAILED" \
   "$OUT/$f.log" | tail -8 | cut -c1-250; done
TILETUNE_LOG=1 timeout -s INT 220 python3 -m tiletune bench fmha --match "H32/8" \
   --json "$OUT/bench_fmha_gqa.json" >"$OUT/bench_fmha_gqa.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_fmha_gqa.log" | cut -c1-800
TILETUNE_LOG=1 timeout -s INT 170 python3 -m tiletune bench matmul --match "x4096x4096 bf16 fwd" \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_mm.log" | cut -c1-600
grep -A1 "^INFO:tiletune:tuned" "$OUT/bench_mm.log" | cut -c1-500
