#!/usr/bin/env bash
# The GPU tests under compute-sanitizer (docs/testing.md):
#   memcheck  - every CUDA test except the multi-GB ones (marker `large`) and the CUDA-graph ones:
#               out-of-bounds and misaligned accesses, invalid frees, errors returned by CUDA calls;
#   memcheck-graphs - the same tool over the CUDA-graph tests (capture and replay, `reduce-overhead`),
#               with PyTorch's caching allocator left on: a capture cannot call cudaMalloc, which
#               every allocation does with the cache off;
#   racecheck - the CUDA tests of the kernels that use shared memory (sparse_mla_decode and
#               sparse_gqa_decode: tl.dot stages its operands there): shared-memory data races;
#   synccheck - the same tests: invalid uses of barriers (divergent or mismatched __syncthreads-style
#               barriers, and mbarrier misuse such as arrivals beyond the expected count).
#
#   bash scripts/sanitize.sh [memcheck|memcheck-graphs|racecheck|synccheck|all] [test files or pytest arguments ...]
#
# Without test arguments: memcheck runs tests/ (but the graph tests), memcheck-graphs the graph tests
# of tests/, racecheck and synccheck the two attention test files. Each
# tool's log goes to $OUT (default ./sanitize_out) with its ERROR SUMMARY; the exit status is non-zero
# when a tool reported an error or a test failed. Expect each tool to take 10-40x the plain run; pass
# one test file at a time to keep a run short (see docs/testing.md for the per-file commands).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHAT=${1:-all}; shift || true
OUT=${OUT:-$REPO/sanitize_out}
mkdir -p "$OUT"

SANITIZER=$(command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$SANITIZER" ] && [ -x "$candidate" ] && SANITIZER=$candidate
done
if [ -z "$SANITIZER" ]; then
  echo "compute-sanitizer not found (it ships with the CUDA toolkit); nothing was checked" | tee "$OUT/summary.txt"
  exit 2
fi

# Every allocation its own block (memcheck and racecheck): an access past a tensor then falls outside
# any allocation and memcheck reports it (the caching allocator would hide it inside a larger block).
# Not for memcheck-graphs (see above).
export TORCHINDUCTOR_COMPILE_THREADS=1  # no compile-worker processes under the sanitizer
export TSM_HYPOTHESIS_PROFILE=ci        # property tests with their CI example counts
export PYTHONUNBUFFERED=1

# The importable package copy of scripts/gpu_suite.sh, and the working directory inside it.
source "$REPO/scripts/_package_copy.sh"

run_tool() {  # mode, marker expression, default targets...; pytest arguments on the command line replace them
  local mode=$1 markers=$2; shift 2
  local targets=("$@")
  [ ${#ARGS[@]} -gt 0 ] && targets=("${ARGS[@]}")
  local tool=${mode%-graphs}
  local log="$OUT/$mode.log"
  echo "== $mode: ${targets[*]}" | tee "$log"
  local extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report analysis)
  local envs=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)  # (any value of it turns the cache off)
  # memcheck-graphs: the cache on, and tests/conftest.py turns off one allocator-state check of
  # inductor's CUDA-graph trees that misfires under the sanitizer (docs/testing.md)
  [ "$mode" = memcheck-graphs ] && envs=(env -u PYTORCH_NO_CUDA_MEMORY_CACHING TSM_UNDER_SANITIZER=1)
  "${envs[@]}" "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 97 --print-limit 200 \
    --target-processes all python3 -m pytest -q -rs -p no:cacheprovider -m "$markers" "${targets[@]}" 2>&1 \
    | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | tail -n 3 | sed "s/^/$mode: /" | tee -a "$OUT/summary.txt"
  # racecheck: which reports are Triton's warp_specialize start-up and which are on the kernels' buffers
  [ "$tool" = racecheck ] && python3 "$REPO/scripts/racecheck_summary.py" "$log" | tee -a "$OUT/summary.txt"
  return "$rc"
}

ARGS=("${@/#/}")
for i in "${!ARGS[@]}"; do  # test files given relative to the repository
  [ -e "$REPO/${ARGS[$i]%%::*}" ] && ARGS[$i]="$REPO/${ARGS[$i]}"
done
: > "$OUT/summary.txt"
rc=0
if [ "$WHAT" = memcheck ] || [ "$WHAT" = all ]; then
  run_tool memcheck "cuda and not large and not graphs" "$REPO/tests" || rc=1
fi
if [ "$WHAT" = memcheck-graphs ] || [ "$WHAT" = all ]; then
  run_tool memcheck-graphs "cuda and not large and graphs" "$REPO/tests" || rc=1
fi
if [ "$WHAT" = racecheck ] || [ "$WHAT" = all ]; then
  run_tool racecheck "cuda and not large" "$REPO/tests/test_sparse_mla.py" "$REPO/tests/test_sparse_gqa.py" || rc=1
fi
if [ "$WHAT" = synccheck ] || [ "$WHAT" = all ]; then
  run_tool synccheck "cuda and not large" "$REPO/tests/test_sparse_mla.py" "$REPO/tests/test_sparse_gqa.py" || rc=1
fi
echo "summary ($OUT/summary.txt):"; cat "$OUT/summary.txt"
exit $rc
