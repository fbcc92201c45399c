#!/usr/bin/env bash
# Session 5, fourth device call: the RMSNorm tests the earlier calls' limits cut (two processes),
# then, alone on the GPU, where split-K wins (explore_splitk.py: skinny shapes, few output tiles).
# Usage on the device: source .device/setup.sh; bash assets/scripts/gpu_s5_call4.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILETUNE_CACHE_DIR=/tmp/store PYTHONFAULTHANDLER=1 CUDA_TILE_COMPILER_TIMEOUT_SEC=60
F=tests/gpu/test_rms_norm.py
t() { local log=$1; shift
      timeout -s INT 260 python3 -m pytest -q -rf -p no:cacheprovider --durations=3 "$@" \
         >"$OUT/$log" 2>&1; echo "rc=$?" >>"$OUT/$log"; }
t t_rms1.log "$F::test_weight_dtype_differs[torch.float32-torch.bfloat16]" "$F::test_second_call_no_search_no_replace_hints" \
   "$F::test_tuned_kernel_is_compiled_once" "$F::test_second_process_reuses_store" \
   "$F::test_eight_threads_cold_key_one_search" "$F::test_torch_compile_fullgraph" "$F::test_cuda_graph_replay" &
t t_rms2.log "$F::test_capture_of_cold_key_does_not_search" "$F::test_non_contiguous_input" "$F::test_empty_batch" \
   "$F::test_bad_input" "$F::test_module_hf_attributes" "$F::test_int32_overflow_rows_are_chunked" \
   "$F::test_examples_run_and_agree" "$F::test_more_than_2_31_elements" "$F::test_aot_signature_matches_jit" &
wait
for f in t_rms1 t_rms2; do echo "== $f"; grep -E "passed|failed|rc=|^E |^FAILED|s call" \
   "$OUT/$f.log" | tail -8 | cut -c1-250; done
timeout -s INT 150 python3 assets/scripts/explore_splitk.py >"$OUT/explore_splitk.log" 2>&1
cat "$OUT/explore_splitk.log" | grep -v -i warn | cut -c1-600
