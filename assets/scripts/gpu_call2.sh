#!/usr/bin/env bash
# Session 3, second device call: RoPE kernel exploration, RoPE/fused GPU tests, missing FMHA rows.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 140 python3 assets/scripts/explore_rope.py >"$OUT/explore_rope.log" 2>&1
tail -8 "$OUT/explore_rope.log"
timeout -s INT 190 python3 -m pytest -q -rf tests/gpu/test_rope.py tests/gpu/test_rms_norm_rope.py \
   -p no:cacheprovider --durations=6 >"$OUT/t_rope.log" 2>&1; echo "rc=$?" >>"$OUT/t_rope.log"
tail -12 "$OUT/t_rope.log"
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match H32/8 --match Sq1024 --match "D64 bf16 causal" --match "D64 bf16 fwd+bwd" \
   --json "$OUT/bench_fmha.json" >"$OUT/bench_fmha.log" 2>&1
grep -v -i warn "$OUT/bench_fmha.log" | grep -v "^INFO" | tail -12 | cut -c1-300
