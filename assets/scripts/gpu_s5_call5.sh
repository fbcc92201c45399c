#!/usr/bin/env bash
# Session 5, fifth device call, on main as it will land (split-K merged with the partly-timed
# final round; the pipelined FMHA forward left on its branch): the FMHA and matmul GPU tests and
# the two RMSNorm tuned cases the earlier calls' limits cut, three processes side by side.
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call5.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
t() { local log=$1; shift
      timeout -s INT 330 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 "$@" \
         >"$OUT/$log" 2>&1; echo "rc=$?" >>"$OUT/$log"; }
t t_fmha.log tests/gpu/test_fmha.py &
t t_mm.log tests/gpu/test_matmul.py &
t t_rms.log "tests/gpu/test_rms_norm.py::test_tuned[(1025, 1001)-torch.bfloat16]" \
   "tests/gpu/test_rms_norm.py::test_tuned[(3, 7)-torch.float32]" &
wait
for f in t_fmha t_mm t_rms; do echo "== $f"; grep -E "passed|failed|rc=|^E |^FAILED|s call" \
   "$OUT/$f.log" | tail -8 | cut -c1-250; done
