#!/usr/bin/env bash
# GPU check: run from the repository root on a CUDA machine whose python3 has CuPy, NumPy,
# ml_dtypes, pytest, pytest-benchmark and hypothesis (the `test` extra) and not cuattn itself
# (pytest's pythonpath makes the checkout importable). Runs
#   1. `python -m cuattn info` and `build --arch sm_90a` (spills under this machine's NVRTC),
#   2. the whole pytest suite, GPU tests included,
#   3. compute-sanitizer memcheck and racecheck over the small GPU tests,
#   4. the benchmarks (pytest-benchmark, JSON),
#   5. (stage `issues` alone, not in `all`) the open issues' target benches, each case timed in
#      turn: #16's e4m3 decode steps beside bf16 (B = 8 and 16 at 8k keys, B = 8 at 16k), the
#      FP8 forward at 8k keys; #19's ALiBi and sinks over the plain call at D = 64, 80, 128 and
#      D = 80 / 160 against D = 96 / 192,
#   6. (stage `wheel` alone, not in `all`, and without step 1) the package as a user installs it:
#      the wheel (WHEEL=path, else built here from the checkout without build isolation, the
#      machine may be offline) installed without dependencies into a site-packages folder of its
#      own that PYTHONPATH puts ahead, then used from an empty folder outside the checkout:
#      scripts/smoke_installed.py (its kernels compiled from the installed sources and run) and
#      `python -m cuattn bench overhead`,
# writing one log per stage to $OUT (a temporary folder when unset). Exit 1 if any stage failed.
# Usage: scripts/gpu_check.sh [all|tests|sanitizer|bench|issues|wheel] [extra pytest args]
# SHARD=I/N runs shard I of N of the test stage (pytest --shard, tests/conftest.py), so that N jobs
# can each take one shard; PROCS=P runs the stage as P pytest processes at once, one shard each
# (logs tests_0.log .. tests_{P-1}.log): with the kernel cache built beforehand
# (`python -m cuattn build --arch sm_90a`, carried in CUATTN_CACHE_DIR) an H100 ran half the suite
# as five processes in about two minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGE=${1:-all}
shift || true
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-$PWD/.cuattn-cache}
# The small cases the sanitizers replay (they run each kernel tens of times slower).
# test_attention.py runs each case on both forward kernels (the Hopper one where it applies).
SANITIZE_TESTS=(tests/test_attention.py tests/test_decode.py tests/test_paged.py tests/test_backward.py tests/test_fp8.py tests/test_paged_varlen.py -k "(test_head_dims_and_block_sizes_on_the_gpu and 2-d64-mha) or (test_dtype_head_dim_mask and bf16) or (test_backward_dtype_head_dim_mask and bf16 and (128 or 64)) or test_windows or test_varlen or ordered_varlen or zero_length or (test_decode_dtype_head_dim_splits and bf16) or test_decode_options or merge_states_of or test_cache_write_and_copy or (test_paged_attention_matches and bf16) or test_paged_attention_sliding_window or sinks or alibi or (e4m3 and bf16) or bit_for_bit or (test_sm90_dq_modes and causal) or (drop_the_blocks and sm90)")
status=0

run() {
    local name=$1
    shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

if [ "$STAGE" != wheel ]; then
    run info "$PY" -m cuattn info
    # the machine's own NVRTC may allocate registers differently from CI's: check spills here too
    run build "$PY" -m cuattn build --arch sm_90a
fi
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
    if [ "${PROCS:-1}" -gt 1 ]; then
        # each process's NumPy reference takes a few cores, not all of them
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-3} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-3}
        pids=()
        for ((i = 0; i < PROCS; i++)); do
            "$PY" -m pytest -q -p no:cacheprovider --ignore=tests/bench --shard "$i/$PROCS" "$@" \
                >"$OUT/tests_$i.log" 2>&1 &
            pids+=($!)
        done
        for ((i = 0; i < PROCS; i++)); do
            wait "${pids[$i]}"
            rc=$?
            echo "=== tests shard $i/$PROCS: $(tail -n 1 "$OUT/tests_$i.log"); exit $rc"
            [ "$rc" -eq 0 ] || status=1
        done
    else
        run tests "$PY" -m pytest -q -p no:cacheprovider --ignore=tests/bench ${SHARD:+--shard "$SHARD"} "$@"
    fi
fi
if [ "$STAGE" = all ] || [ "$STAGE" = sanitizer ]; then
    run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 --target-processes all \
        "$PY" -m pytest -q -p no:cacheprovider "${SANITIZE_TESTS[@]}"
    run racecheck compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 1 \
        --target-processes all "$PY" -m pytest -q -p no:cacheprovider "${SANITIZE_TESTS[@]}"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
    run bench "$PY" -m pytest -q -p no:cacheprovider tests/bench --benchmark-json="$OUT/bench.json" \
        --benchmark-columns=median,rounds "$@"
fi
if [ "$STAGE" = issues ]; then
    run issue16_decode "$PY" scripts/compare_fp8_decode.py --rounds=3 8:8192 16:8192 8:16384
    run issue16_fp8_forward "$PY" scripts/bench_fp8_fwd.py --lengths 8192 --head-dims 128,256 --rounds 3
    run issue19_variants "$PY" scripts/bench_variants.py --lengths 1024,4096 --head-dims 64,80,128 --rounds 3
    run issue19_head_dims "$PY" scripts/bench_head_dims.py --head-dims 80,96,160,192 --forward-only --rounds 3
fi
if [ "$STAGE" = wheel ]; then
    where=$(mktemp -d)
    python=$("$PY" -c "import sys; print(sys.executable)")  # absolute: the runs below start elsewhere
    wheel=${WHEEL:-}
    if [ -z "$wheel" ]; then
        run wheel_build "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$where" .
        wheel=$(ls "$where"/cuattn-*.whl 2>/dev/null | head -n 1)
    fi
    if [ -z "$wheel" ]; then
        echo "=== wheel: no wheel to install (pass WHEEL=path where this machine cannot build one)"
        exit 1
    fi
    run wheel_install "$python" -m pip install --quiet --no-deps --no-index --target "$where/site-packages" "$wheel"
    mkdir -p "$where/outside"
    # the installed package's Python, started outside the checkout
    installed=(env -C "$where/outside" PYTHONPATH="$where/site-packages" "$python")
    run smoke_installed "${installed[@]}" "$PWD/scripts/smoke_installed.py"
    run overhead "${installed[@]}" -m cuattn bench overhead
fi
echo "logs in $OUT; overall status $status"
exit $status
