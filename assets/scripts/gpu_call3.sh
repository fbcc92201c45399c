#!/usr/bin/env bash
# Session 3, third device call: RoPE/fused GPU tests (two processes), RoPE benchmarks, matmul
# benchmarks with TileGym.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
(timeout -s INT 230 python3 -m pytest -q -rf tests/gpu/test_rms_norm_rope.py -p no:cacheprovider \
   --durations=4 >"$OUT/t_fused.log" 2>&1; echo "rc=$?" >>"$OUT/t_fused.log") &
timeout -s INT 230 python3 -m pytest -q -rf tests/gpu/test_rope.py -p no:cacheprovider \
   --durations=6 >"$OUT/t_rope.log" 2>&1; echo "rc=$?" >>"$OUT/t_rope.log"
wait
tail -5 "$OUT/t_rope.log"; tail -5 "$OUT/t_fused.log"
TILETUNE_LOG=1 timeout -s INT 110 python3 -m tiletune bench rope rms_norm_rope \
   --json "$OUT/bench_rope.json" >"$OUT/bench_rope.log" 2>&1
grep -v -i warn "$OUT/bench_rope.log" | grep -v "^INFO" | tail -6 | cut -c1-400
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench matmul \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -v -i warn "$OUT/bench_mm.log" | grep -v "^INFO" | tail -16 | cut -c1-300
