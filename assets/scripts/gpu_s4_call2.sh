#!/usr/bin/env bash
# Session 4, second device call: the rebuilt matmul space (8-worker-warp 128x256 / 256x128 /
# 128x128 tiles, persistent and not, 256x256 in 2-CTA clusters): the whole GPU test file (every
# config on a ragged batched problem included), then `bench matmul` alone on the GPU (candidates
# timed in turns). The tuned store comes back in $OUT/store.
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s4_call2.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=$OUT/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 250 python3 -m pytest -q -rf tests/gpu/test_matmul.py -p no:cacheprovider \
   --durations=5 >"$OUT/t_mm.log" 2>&1; echo "rc=$?" >>"$OUT/t_mm.log"
tail -12 "$OUT/t_mm.log" | cut -c1-300
rm -rf "$OUT/store"       # the bench searches afresh (tuning time per key is one of its columns)
TILETUNE_LOG=1 timeout -s INT 230 python3 -m tiletune bench matmul \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -v -i warn "$OUT/bench_mm.log" | grep -v "^INFO" | grep -v "^tuned" | tail -12 | cut -c1-300
grep -E "^tuned matmul|failed" "$OUT/bench_mm.log" | cut -c1-230 | head -14
