#!/usr/bin/env bash
# The whole GPU check in one call, on any CUDA machine: the full test suite (its CUDA tests included:
# parity, manual CUDA-graph capture and replay, reduce-overhead capture), the demo and the benchmarks.
# Logs, the benchmark tables and the roofline plot go to $OUT (default ./gpu_out).
#   bash scripts/gpu_suite.sh [tests|demo|bench|all] [test files, relative to the repo (default: tests/)]
# Extra arguments for the benchmark: BENCH_ARGS (e.g. BENCH_ARGS="--quick --peak-tbps 4.3").
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
  python3 -m pytest -q -rs -p no:cacheprovider "${targets[@]}" 2>&1 | tee "$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
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
