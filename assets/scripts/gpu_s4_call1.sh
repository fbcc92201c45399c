#!/usr/bin/env bash
# Session 4, first device call: the merged persistent/skinny matmul space (full GPU test file,
# every-config tests included) || every FMHA config; then `bench matmul` alone on the GPU; then
# the missing FMHA row (Sq != Sk fwd+bwd).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s4_call1.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
(timeout -s INT 220 python3 -m pytest -q -rf tests/gpu/test_fmha.py -k every_config \
   -p no:cacheprovider --durations=3 >"$OUT/t_fmha_every.log" 2>&1; echo "rc=$?" >>"$OUT/t_fmha_every.log") &
timeout -s INT 230 python3 -m pytest -q -rf tests/gpu/test_matmul.py -p no:cacheprovider \
   --durations=5 >"$OUT/t_mm.log" 2>&1; echo "rc=$?" >>"$OUT/t_mm.log"
wait
tail -12 "$OUT/t_mm.log" | cut -c1-300; tail -6 "$OUT/t_fmha_every.log" | cut -c1-300
TILETUNE_LOG=1 timeout -s INT 190 python3 -m tiletune bench matmul \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -v -i warn "$OUT/bench_mm.log" | grep -v "^INFO" | tail -16 | cut -c1-300
grep -E "tuned matmul|failed" "$OUT/bench_mm.log" | cut -c1-260 | head -14
TILETUNE_LOG=1 timeout -s INT 130 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "Sq1024 Sk4096 D128 bf16 causal fwd+bwd" --json "$OUT/bench_fmha.json" \
   >"$OUT/bench_fmha.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_fmha.log" | cut -c1-500
