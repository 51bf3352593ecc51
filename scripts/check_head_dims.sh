#!/usr/bin/env bash
# GPU check of issue #19's head dims, from the repository root on a CUDA machine (python3 with
# cupy, pytest; compute-sanitizer on PATH). Writes one log per stage to $OUT (a temporary folder
# when unset); exit 1 if a stage failed.
#   1. build: every variant for this GPU's arch, in parallel groups (spills under this NVRTC)
#   2. tests: the GPU tests at the padded head dims (8, 40, 104, 200) and the new tiles (80, 160)
#   3. memcheck: compute-sanitizer on one small case per kernel family at a padded head dim
#   4. bench: scripts/bench_head_dims.py (forward and backward TFLOP/s per head dim, JSON)
# Usage: scripts/check_head_dims.sh [all | one or more of build tests memcheck bench]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
STAGES=" ${*:-all} "
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-$PWD/.cuattn-cache}
ARCH=$("$PY" -c "from cuattn import _jit; print(_jit.target_arch())")
# kernel name groups compiled side by side (each `build` call compiles its group one by one)
KERNEL_GROUPS=("flash_fwd_kernel<__half" "flash_fwd_kernel<__nv_bfloat16" "flash_bwd_kernel<__half"
               "flash_bwd_kernel<__nv_bfloat16" "flash_bwd_dq_kernel" "decode_kernel<__half" "decode_kernel<__nv_bfloat16"
               "flash_fwd_sm90" "flash_bwd_sm90" "convert" "preprocess" "combine" "cache_write" "copy_blocks" "fp8_")
TESTS=(tests/test_head_dims.py tests/test_attention.py tests/test_backward.py tests/test_decode.py tests/test_paged.py
       tests/test_paged_varlen.py tests/test_fp8.py)
DIMS="-8- or -40- or -80- or -104- or -160- or -200-"
# (pytest's -k takes one line)
SELECT="test_head_dims or ((head_dim_mask or test_decode_dtype_head_dim_splits) and ($DIMS))"
SELECT+=" or (test_varlen_matches_per_sequence_dense and (40 or 200)) or (test_varlen_backward_matches and (40 or 104))"
SELECT+=" or (test_head_dims_and_block_sizes_on_the_gpu and (d40 or d200))"
SELECT+=" or (runs_across_pages and ([8- or [80- or [104-)) or (e4m3 and (-80- or -160- or -80] or -160]))"
# one small case per kernel family at a padded head dim (or a new tile's)
SANITIZE=(
    "tests/test_head_dims.py::test_padded_and_new_tile_head_dims_run_the_mma_sync_forward[40]"
    "tests/test_attention.py::test_varlen_matches_per_sequence_dense[mma-200]"
    "tests/test_backward.py::test_varlen_backward_matches_per_sequence_reference[atomic-causal-40]"
    "tests/test_backward.py::test_varlen_backward_matches_per_sequence_reference[deterministic-full-104]"
    "tests/test_backward.py::test_backward_dtype_head_dim_mask[bf16-160-window-deterministic]"
    "tests/test_decode.py::test_decode_dtype_head_dim_splits[bf16-40-3splits]"
    "tests/test_fp8.py::test_decode_e4m3_cache[bf16-80-auto-per-head]"
    "tests/test_paged.py::test_paged_attention_head_dims_with_runs_across_pages[104-3]"
    "tests/test_paged_varlen.py::test_head_dims_and_block_sizes_on_the_gpu[2-d40-gqa]"
)
status=0

want() {
    [[ $STAGES == *" all "* || $STAGES == *" $1 "* ]]
}

run() {
    local name=$1
    shift
    echo "=== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

if want build; then
    i=0
    for group in "${KERNEL_GROUPS[@]}"; do
        "$PY" -m cuattn build --arch "$ARCH" --kernels "$group" > "$OUT/build_$i.log" 2>&1 &
        i=$((i + 1))
    done
    wait
    cat "$OUT"/build_*.log > "$OUT/build.log"
    grep -h "failed or spilled" "$OUT"/build_*.log
    grep -q "[1-9][0-9]* failed or spilled" "$OUT/build.log" && status=1
fi
if want tests; then
    run tests "$PY" -m pytest -q -p no:cacheprovider -rf "${TESTS[@]}" -k "$SELECT"
fi
if want memcheck; then
    run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 --target-processes all \
        "$PY" -m pytest -q -p no:cacheprovider "${SANITIZE[@]}"
fi
if want bench; then
    run bench "$PY" scripts/bench_head_dims.py --json "$OUT/bench_head_dims.json"
fi
echo "logs in $OUT; overall status $status"
exit $status
