#!/usr/bin/env bash
# Session 4, third device call: the engine's final round (close finishers and the default timed
# again in turns) on the GPU: the tuned-path tests of every op, then `bench matmul` (fresh
# searches), then the D64 FMHA rows with TileGym side by side.
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s4_call3.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
(timeout -s INT 150 python3 -m pytest -q -rf tests/gpu/test_fmha.py -k "tuned and not every_config" \
   -p no:cacheprovider >"$OUT/t_fmha.log" 2>&1; echo "rc=$?" >>"$OUT/t_fmha.log") &
timeout -s INT 150 python3 -m pytest -q -rf tests/gpu/test_rms_norm.py tests/gpu/test_rope.py \
   tests/gpu/test_rms_norm_rope.py tests/gpu/test_matmul.py -k "tuned and not every_config and not 4097" \
   -p no:cacheprovider >"$OUT/t_tuned.log" 2>&1; echo "rc=$?" >>"$OUT/t_tuned.log"
wait
tail -4 "$OUT/t_tuned.log" | cut -c1-300; tail -4 "$OUT/t_fmha.log" | cut -c1-300
rm -rf /tmp/store
TILETUNE_LOG=1 timeout -s INT 190 python3 -m tiletune bench matmul \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -v -i warn "$OUT/bench_mm.log" | grep -v "^INFO" | grep -v "^tuned" | tail -11 | cut -c1-300
TILETUNE_LOG=1 timeout -s INT 180 python3 -m tiletune bench fmha --match "S2048 D64" \
   --json "$OUT/bench_fmha.json" >"$OUT/bench_fmha.log" 2>&1
grep -E "^\{|failed" "$OUT/bench_fmha.log" | cut -c1-600
