#!/usr/bin/env bash
# Session 4, fifth device call (the budget's last ~3 minutes): the final round on in-place RoPE
# (inputs intact through search and final round), tuned RoPE, fused and one odd matmul, with the
# engine's INFO log (search wall time per key, final-round lines).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
timeout -s INT 110 python3 -m pytest -q -rf -p no:cacheprovider --durations=5 \
   -o log_cli=true --log-cli-level=INFO \
   "tests/gpu/test_rope.py::test_inplace_search_leaves_inputs_intact" \
   "tests/gpu/test_rope.py::test_forward_backward[(2, 32, 8, 423, 128, 128, False, False)-torch.bfloat16-tuned]" \
   "tests/gpu/test_rms_norm_rope.py::test_forward_backward[(3, 7, 1, 51, 80, 40, True)-torch.float32-tuned]" \
   "tests/gpu/test_matmul.py::test_layouts_and_odd_sizes[tuned-torch.bfloat16-NN-(1000, 1999, 777)]" \
   >"$OUT/t_final.log" 2>&1; echo "rc=$?" >>"$OUT/t_final.log"
grep -E "passed|failed|rc=|s call" "$OUT/t_final.log" | tail -8 | cut -c1-200
grep -c "final round" "$OUT/t_final.log"; grep -E "tuned .* in [0-9.]+s" "$OUT/t_final.log" | grep -oE "tuned [a-z_]+ |in [0-9.]+s" | paste - - | head -12
