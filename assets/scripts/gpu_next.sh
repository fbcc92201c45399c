#!/usr/bin/env bash
# Next device call (planned at the end of session 4, not yet run). In order of what it settles:
# 1. issue #5's last row: the GQA FMHA rows with TileGym side by side;
# 2. the engine's final-round robustness change (device context, flush buffer dropped, failure
#    kept out of the op) under every op's tuned tests, alone on the GPU;
# 3. RoPE leftovers from session 3: explore_rope2 and the in-place bench row.
# Then, on branch fmha-pipelined (merge main first): assets/scripts/gpu_pipelined.sh (the
# software-pipelined FMHA forward: correctness of every config, then the forward rows); on
# branch matmul-splitk (merge main first): assets/scripts/gpu_splitk.sh (split-K for skinny M).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_next.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench fmha --match "H32/8" \
   --json "$OUT/bench_fmha_gqa.json" >"$OUT/bench_fmha_gqa.log" 2>&1
grep -E "^\{|failed|final round" "$OUT/bench_fmha_gqa.log" | cut -c1-600
TILETUNE_LOG=1 timeout -s INT 240 python3 -m pytest -q -rf -p no:cacheprovider --durations=8 \
   tests/gpu/test_rope.py tests/gpu/test_rms_norm_rope.py tests/gpu/test_fmha.py tests/gpu/test_matmul.py \
   -k "tuned and not every_config and not 4097" >"$OUT/t_tuned.log" 2>&1; echo "rc=$?" >>"$OUT/t_tuned.log"
grep -E "passed|failed|rc=|s call" "$OUT/t_tuned.log" | tail -12 | cut -c1-200
timeout -s INT 120 python3 assets/scripts/explore_rope2.py >"$OUT/explore_rope2.log" 2>&1
tail -8 "$OUT/explore_rope2.log"
TILETUNE_LOG=1 timeout -s INT 100 python3 -m tiletune bench rope --match inplace \
   --json "$OUT/bench_rope_inplace.json" >"$OUT/bench_rope_inplace.log" 2>&1
grep "^{" "$OUT/bench_rope_inplace.log" | cut -c1-600
