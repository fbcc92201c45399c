#!/usr/bin/env bash
# One device call that runs every GPU test and the benchmarks, logs under $OUT (or /tmp/out).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_session.sh [ops...]
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=${TILETUNE_CACHE_DIR:-/tmp/tiletune-store} PYTHONFAULTHANDLER=1
timeout ${TEST_TIMEOUT:-360} python3 -m pytest -q -rf tests/gpu -p no:cacheprovider --durations=10 \
  >"$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?"
grep -E "^E  |^FAILED|passed|failed|error" "$OUT/gpu_tests.log" | head -40
timeout ${BENCH_TIMEOUT:-200} python3 -m tiletune bench "$@" --json "$OUT/bench.json" 2>&1 \
  | grep -v -i warn >"$OUT/bench.log"
tail -30 "$OUT/bench.log" | cut -c1-300
