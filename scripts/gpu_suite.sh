#!/usr/bin/env bash
# The whole GPU check in one call, on any CUDA machine: the full test suite (its CUDA tests included:
# parity, manual CUDA-graph capture and replay, reduce-overhead capture), the demo and the benchmarks.
# Logs, the benchmark tables and the roofline plot go to $OUT (default ./gpu_out).
#   bash scripts/gpu_suite.sh [tests|demo|bench|all] [test files, relative to the repo (default: tests/)]
# Extra arguments for the benchmark: BENCH_ARGS (e.g. BENCH_ARGS="--quick --peak-tbps 4.3").
# JOBS=N (default 1) deals the collected tests round-robin to N pytest processes sharing the GPU (logs
# $OUT/pytest.<i>.log, all of them in $OUT/pytest.log); the whole suite takes well over ten minutes in
# one process on an H200. Each process holds its own CUDA context and test tensors: size N to the GPU.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHAT=${1:-all}; shift || true
OUT=${OUT:-$REPO/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# An importable copy of the package, and the working directory inside it.
source "$REPO/scripts/_package_copy.sh"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

rc=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  targets=("$REPO/tests"); [ $# -gt 0 ] && targets=("${@/#/$REPO/}")
  if [ "${JOBS:-1}" -gt 1 ]; then
    # test ids are relative to the repository (pytest's rootdir); this shell runs inside the copy
    if ! python3 -m pytest -q --collect-only -p no:cacheprovider "${targets[@]}" > "$OUT/pytest.log" 2>&1; then
      tail -n 30 "$OUT/pytest.log"; echo "collecting the tests failed (above)"; exit 1
    fi
    grep '::' "$OUT/pytest.log" | sed "s|^|$REPO/|" > "$OUT/pytest.items"
    echo "$(wc -l < "$OUT/pytest.items") tests over $JOBS processes"
    pids=()
    for ((j = 0; j < JOBS; j++)); do
      awk -v n="$JOBS" -v j="$j" '(NR - 1) % n == j' "$OUT/pytest.items" \
        | xargs -r -d '\n' python3 -m pytest -q -rfEs -p no:cacheprovider > "$OUT/pytest.$j.log" 2>&1 &
      pids+=($!)
    done
    : > "$OUT/pytest.log"
    for ((j = 0; j < JOBS; j++)); do
      wait "${pids[j]}" || rc=1
      echo "process $j: $(grep -E '(passed|failed|error)' "$OUT/pytest.$j.log" | tail -n 1)"
      grep -E '^(FAILED|ERROR) ' "$OUT/pytest.$j.log"
      cat "$OUT/pytest.$j.log" >> "$OUT/pytest.log"  # this run's logs only, not older ones in $OUT
    done
  else
    python3 -m pytest -q -rfEs -p no:cacheprovider "${targets[@]}" 2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
  fi
fi
if [ "$WHAT" = demo ] || [ "$WHAT" = all ]; then
  python3 -m torch_sparse_mla.demo 2>&1 | tee "$OUT/demo.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  # shellcheck disable=SC2086
  python3 -m torch_sparse_mla.bench all --out "$OUT/benchmarks.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit $rc
