#!/usr/bin/env bash
# GPU check: build orca_ext from source with this machine's torch, run the CUDA tests and the
# CUDA op benchmarks; results under $OUT (default ./gpu_results). Needs no network.
#
#   OUT=/path/to/results bash bench/gpu_check.sh
#
# Budget: under 9 minutes in all (build <= 270 s for one architecture, tests <= 140 s,
# benchmarks <= 120 s); every stage has its own timeout so a hang cannot eat the rest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python}
START=$(date +%s)
STATUS=0
step() { printf '\n=== [gpu-check %3ss] %s\n' "$(( $(date +%s) - START ))" "$*" | tee -a "$OUT/summary.txt"; }

step "machine"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPU', torch.cuda.get_device_name(0))"
  nvcc --version | tail -n 2
} 2>&1 | tee "$OUT/machine.txt"

# Build only for this GPU unless told otherwise (the default list is sm_80, sm_90 + PTX).
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  export TORCH_CUDA_ARCH_LIST
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if command -v ccache >/dev/null; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
fi

step "build (ORCA_EXT_CUDA=ON, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
if ! ORCA_EXT_CUDA=ON timeout 270 "$PY" -m pip install --no-build-isolation --no-deps -v . \
    >"$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  step "BUILD FAILED (see build.log)"
  exit 1
fi
grep -E "orca_ext:" "$OUT/build.log" | sed 's/^ *//'

# Tests and benchmarks run outside the source tree so the installed build is imported.
RUN_DIR=$(mktemp -d)

step "CUDA tests: tests/test_ops.py tests/test_cuda.py -k cuda"
(cd "$RUN_DIR" && timeout 140 "$PY" -m pytest -q -p no:cacheprovider --maxfail=20 \
    "$ROOT/tests/test_ops.py" "$ROOT/tests/test_cuda.py" -k cuda \
    --junitxml="$OUT/pytest_cuda.xml") >"$OUT/pytest_cuda.log" 2>&1
RC=$?
tail -n 25 "$OUT/pytest_cuda.log"
[[ $RC -eq 0 ]] || { STATUS=1; step "CUDA TESTS FAILED (rc $RC, see pytest_cuda.log)"; }

step "CUDA op benchmarks: bench/ops_cuda.py"
(cd "$RUN_DIR" && timeout 120 "$PY" "$ROOT/bench/ops_cuda.py" --out "$OUT/ops_cuda.json") \
    2>&1 | tee "$OUT/ops_cuda.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { STATUS=1; step "BENCHMARKS FAILED"; }

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
step "distributed (NCCL, one worker per GPU): tests/test_distributed.py -k cuda ($NGPU GPUs)"
(cd "$RUN_DIR" && timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
    "$ROOT/tests/test_distributed.py" -k cuda) >"$OUT/pytest_distributed.log" 2>&1
RC=$?
tail -n 15 "$OUT/pytest_distributed.log"
[[ $RC -eq 0 ]] || { STATUS=1; step "DISTRIBUTED TESTS FAILED (rc $RC, see pytest_distributed.log)"; }
if (( NGPU >= 2 )); then
  for LAYOUT in "--tp 2" "--pp 2"; do
    step "distributed benchmark: bench/engine.py --device cuda $LAYOUT"
    (cd "$RUN_DIR" && timeout 120 "$PY" "$ROOT/bench/engine.py" --device cuda --policies orca $LAYOUT) \
        2>&1 | tee -a "$OUT/distributed.txt"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || { STATUS=1; step "DISTRIBUTED BENCHMARK FAILED ($LAYOUT)"; }
  done
fi

step "done (status $STATUS); results in $OUT"
exit $STATUS
