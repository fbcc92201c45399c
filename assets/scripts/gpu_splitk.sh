#!/usr/bin/env bash
# Branch matmul-splitk (not yet run on a GPU): persistent 2-CTA-cluster configs, and split-K
# configs for keys with at most a wave of
# output tiles (decode/skinny M). First correctness (every config, split-K 2/4/8 at K = 2000,
# ragged, batched; poisoned outputs), then the bench's skinny rows and 4096^3 (where
# split-K configs are not in the space at 4096^3: a check that nothing else moved).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_splitk.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 240 python3 -m pytest -q -rf -p no:cacheprovider --durations=5 tests/gpu/test_matmul.py \
   -k "every_config or (tuned and 1000) or gradients or example" >"$OUT/t_mm.log" 2>&1
echo "rc=$?" >>"$OUT/t_mm.log"
grep -E "passed|failed|rc=|s call|^E " "$OUT/t_mm.log" | tail -12 | cut -c1-250
grep -q "failed" "$OUT/t_mm.log" && exit 1
TILETUNE_LOG=1 timeout -s INT 200 python3 -m tiletune bench matmul --match "x4096x4096 bf16 fwd" \
   --json "$OUT/bench_mm.json" >"$OUT/bench_mm.log" 2>&1
grep -v -i warn "$OUT/bench_mm.log" | grep -v "^INFO" | grep -v "^tuned" | tail -8 | cut -c1-300
grep "final round" "$OUT/bench_mm.log" | cut -c1-400
