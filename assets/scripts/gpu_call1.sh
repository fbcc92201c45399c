#!/usr/bin/env bash
# Session 3, first device call: GPU tests (rope, fused, matmul) then the RoPE benchmarks.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv >"$OUT/gpu.txt"
(timeout 300 python3 -m pytest -q -rf tests/gpu/test_rope.py tests/gpu/test_rms_norm_rope.py \
   -p no:cacheprovider --durations=5 >"$OUT/t_rope.log" 2>&1; echo "rc=$?" >>"$OUT/t_rope.log") &
timeout 320 python3 -m pytest -q -rf tests/gpu/test_matmul.py -p no:cacheprovider --durations=8 \
   >"$OUT/t_mm.log" 2>&1; echo "rc=$?" >>"$OUT/t_mm.log"
wait
tail -4 "$OUT/t_rope.log"; tail -4 "$OUT/t_mm.log"
TILETUNE_LOG=1 timeout ${BENCH_TIMEOUT:-170} python3 -m tiletune bench rope rms_norm_rope \
   --json "$OUT/bench_rope.json" >"$OUT/bench_rope.log" 2>&1
grep -v -i warn "$OUT/bench_rope.log" | tail -25 | cut -c1-400
