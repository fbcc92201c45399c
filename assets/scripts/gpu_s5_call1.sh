#!/usr/bin/env bash
# Session 5, first device call, on main + fmha-pipelined + matmul-splitk merged (branch s5):
# the whole GPU test suite in three processes side by side (compiles are CPU-bound: 16 cores),
# which covers the pipelined FMHA forward, split-K, the final round's robustness change, the
# NaN-poisoned matmul outputs and the each_config() refactor; then, alone on the GPU, the D128
# forward rows where the search decides between the plain and the pipelined forward.
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call1.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
t() { local log=$1; shift
      timeout -s INT 320 python3 -m pytest -q -rf -p no:cacheprovider --durations=4 "$@" \
         >"$OUT/$log" 2>&1; echo "rc=$?" >>"$OUT/$log"; }
t t_fmha.log tests/gpu/test_fmha.py &
t t_mm.log tests/gpu/test_matmul.py &
t t_rest.log tests/gpu/test_rope.py tests/gpu/test_rms_norm_rope.py tests/gpu/test_rms_norm.py &
wait
for f in t_fmha t_mm t_rest; do echo "== $f"; grep -E "passed|failed|rc=|s call|^E |^FAILED" \
   "$OUT/$f.log" | tail -14 | cut -c1-250; done
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench fmha --skip-peer tilegym \
   --match "S4096 D128 bf16 fwd$" --match "S4096 D128 bf16 causal fwd$" \
   --json "$OUT/bench_fmha_fwd.json" >"$OUT/bench_fmha_fwd.log" 2>&1
grep -E "^\{|final round|failed" "$OUT/bench_fmha_fwd.log" | cut -c1-700
