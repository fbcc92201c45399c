#!/usr/bin/env bash
# Session 4, fourth device call: the tuned-path GPU tests of RMSNorm, RoPE, fused RMSNorm+RoPE
# and matmul (odd sizes) with the engine's final round, alone on the GPU (the third call ran them
# beside the FMHA tests and its limit stopped them after 3).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s4_call4.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
TILETUNE_LOG=1 timeout -s INT 240 python3 -m pytest -q -rf tests/gpu/test_rms_norm.py tests/gpu/test_rope.py \
   tests/gpu/test_rms_norm_rope.py tests/gpu/test_matmul.py \
   -k "tuned and not every_config and not 4097 and (not matmul or 1000)" \
   -p no:cacheprovider --durations=8 >"$OUT/t_tuned.log" 2>&1; echo "rc=$?" >>"$OUT/t_tuned.log"
grep -v "^INFO\|^  " "$OUT/t_tuned.log" | tail -14 | cut -c1-300
grep -c "final round" "$OUT/t_tuned.log"; grep "^INFO:tiletune:tuned" "$OUT/t_tuned.log" | grep -o " in [0-9.]*s" | tr '\n' ' '
