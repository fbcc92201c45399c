#!/usr/bin/env bash
# Session 3, fourth device call: FMHA tests || (rest of RoPE tests, fused tests), then the
# missing FMHA benchmark rows (GQA fwd+bwd, Sq != Sk).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
(timeout -s INT 270 python3 -m pytest -q -rf tests/gpu/test_fmha.py -p no:cacheprovider \
   --durations=5 >"$OUT/t_fmha.log" 2>&1; echo "rc=$?" >>"$OUT/t_fmha.log") &
timeout -s INT 270 python3 -m pytest -q -rf tests/gpu/test_rms_norm_rope.py tests/gpu/test_rope.py \
   -k "rms_norm_rope or torch_compile or example_pair or bad_input" -p no:cacheprovider \
   --durations=5 >"$OUT/t_rope.log" 2>&1; echo "rc=$?" >>"$OUT/t_rope.log"
wait
tail -4 "$OUT/t_rope.log"; tail -4 "$OUT/t_fmha.log"
TILETUNE_LOG=1 timeout -s INT 150 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "H32/8 S4096 D128 bf16 causal fwd+bwd" --match Sq1024 \
   --json "$OUT/bench_fmha.json" >"$OUT/bench_fmha.log" 2>&1
grep "^{" "$OUT/bench_fmha.log" | cut -c1-600
