#!/usr/bin/env bash
# Next device call (planned at the end of session 3, not yet run): the tests and measurements
# that session 3 could not fit. On main; then the same with the matmul-persistent branch checked
# out (TESTS=tests/gpu/test_matmul.py BENCH=matmul).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_next.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
# 1. timing-sensitive first, alone on the GPU
timeout -s INT 120 python3 assets/scripts/explore_rope2.py >"$OUT/explore_rope2.log" 2>&1
tail -8 "$OUT/explore_rope2.log"
# 1b. RoPE in place against the same peers (TileGym and Liger rotate in place)
TILETUNE_LOG=1 timeout -s INT 100 python3 -m tiletune bench rope --match inplace \
   --json "$OUT/bench_rope_inplace.json" >"$OUT/bench_rope_inplace.log" 2>&1
grep "^{" "$OUT/bench_rope_inplace.log" | cut -c1-600
# 2. tests not yet run on the GPU: every matmul config on a ragged batched problem
timeout -s INT 150 python3 -m pytest -q -rf tests/gpu/test_matmul.py -k "every_config" \
   -p no:cacheprovider >"$OUT/t_mm_every.log" 2>&1; tail -3 "$OUT/t_mm_every.log"
timeout -s INT 240 python3 -m pytest -q -rf tests/gpu/test_fmha.py -k "every_config" \
   -p no:cacheprovider --durations=3 >"$OUT/t_fmha_every.log" 2>&1; tail -5 "$OUT/t_fmha_every.log"
# 3. the missing FMHA row (Sq != Sk fwd+bwd), failure messages now logged
TILETUNE_LOG=1 timeout -s INT 150 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "Sq1024 Sk4096 D128 bf16 causal fwd+bwd" --json "$OUT/bench_fmha.json" \
   >"$OUT/bench_fmha.log" 2>&1
grep -E "^\{|failed:" "$OUT/bench_fmha.log" | cut -c1-500
# 4. why batched-gradient matmul searches miss the precompiled cubins
timeout -s INT 120 python3 assets/scripts/precompile_check.py >"$OUT/precompile_check.log" 2>&1
tail -20 "$OUT/precompile_check.log" | cut -c1-300
