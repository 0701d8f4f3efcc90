#!/usr/bin/env bash
# GPU check in one run that always reports: build orca_ext from source against this machine's
# torch (ORCA_EXT_CUDA=ON, sm_90, -lineinfo, ptxas -v), run one smoke case per kernel path,
# compute-sanitizer memcheck / racecheck / synccheck on the small cases, the CUDA tests, the
# CUDA op benchmarks and orca-tiny on CUDA against the CPU.
#
#   OUT=/path/to/results bash bench/gpu_check.sh        # default OUT: ./gpu_results
#
# Every step runs under its own `timeout` (SIGINT first, so pytest still prints its summary;
# SIGKILL 10 s later) inside a global deadline (ORCA_GPU_CHECK_DEADLINE, default 520 s); a step
# with too little time left is skipped. summary.txt (versions, the step lines, the first compile
# errors, ptxas registers/spills, the smoke/sanitizer/test/benchmark verdicts) is rewritten after
# every step and by an exit trap, so even a killed run leaves one. At most 7 files under $OUT:
# summary.txt build.log smoke.log sanitizer.log pytest.log bench.log bench.json.
# Exit status: 0 every step ran and passed, 1 a step failed, 2 none failed but some were
# skipped (INCOMPLETE).
# Overrides: ORCA_GPU_PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0),
# ORCA_GPU_BUILD_BUDGET (the build's limit, default 240 s).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${ORCA_GPU_PYTHON:-python3}
DEADLINE=${ORCA_GPU_CHECK_DEADLINE:-520}
RESERVE=10  # seconds kept for the final summary
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
START=$SECONDS
WORK=$(mktemp -d)  # scratch: the step lines, facts, the pytest plugin, the run directory
RUN_DIR=$WORK/run  # tests and benchmarks run here, so the installed orca_ext is imported
mkdir -p "$RUN_DIR"
: >"$WORK/steps.txt"
: >"$WORK/facts.txt"
FAILED=0
SKIPPED=0
HAVE_TORCH=0
HAVE_GPU=0
BUILT=0

elapsed() { echo $(( SECONDS - START )); }
left() { echo $(( DEADLINE - (SECONDS - START) - RESERVE )); }
note() { printf '%s\n' "$*" | tee -a "$WORK/steps.txt"; }

# ptxas -v lines of build.log as one line per kernel: registers, spills, shared memory.
ptxas_table() {
  awk '
    /Compiling entry function/ { fn = $0; sub(/.*function .\047?/, "", fn); sub(/\047.*/, "", fn) }
    /bytes spill stores/ { st = $5; ld = $9 }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
      smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
      printf "regs=%-3s spill_st=%-4s spill_ld=%-4s smem=%-6s %s\n", regs, st, ld, smem, fn
    }' "$OUT/build.log" 2>/dev/null | { if command -v c++filt >/dev/null; then c++filt; else cat; fi; } |
    sed -E 's/orca::cuda:://g' | sort -u | sort -t= -k2,2nr
}

write_summary() {
  {
    echo "orca_ext GPU check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(elapsed) s of ${DEADLINE} s"
    echo "== facts"
    cat "$WORK/facts.txt"
    echo "== steps"
    cat "$WORK/steps.txt"
    if [[ -s "$OUT/build.log" ]]; then
      echo "== first compile errors (build.log)"
      grep -n -m 20 -E 'error:|error [A-Z]*[0-9]+|FAILED:|CMake Error|fatal error|^ERROR: ' \
        "$OUT/build.log" | cut -c1-300 || echo "(none)"
      echo "== ptxas: registers / spills per kernel (sm_$(echo "$TORCH_CUDA_ARCH_LIST" | tr -d '.'))"
      ptxas_table | head -n 80 | grep . || echo "(no ptxas lines: no kernel was compiled in this run)"
    fi
    if [[ -s "$OUT/smoke.log" ]]; then
      echo "== smoke (bench/cuda_smoke.py)"
      grep -E '^(OK|FAIL|ABORT|smoke:|  CUDA graph)' "$OUT/smoke.log" | cut -c1-300 | head -n 60
    fi
    if [[ -s "$OUT/sanitizer.log" ]]; then
      echo "== compute-sanitizer"
      grep -E '^(### |=+ ERROR SUMMARY|=+ (Invalid|Race|Barrier|Error|Warning|Program hit))' \
        "$OUT/sanitizer.log" | cut -c1-300 | head -n 40
    fi
    if [[ -s "$OUT/pytest.log" ]]; then
      echo "== pytest"
      grep -E '^(### |FAILED|ERROR|=+ .*(passed|failed|error|skipped|deselected).* =+$|.*poisoned)' \
        "$OUT/pytest.log" | cut -c1-300 | head -n 60
    fi
    if [[ -s "$OUT/bench.log" ]]; then
      echo "== benchmarks (bench/ops_cuda.py --quick)"
      grep -E '^(PASS|FAIL|ERROR|[0-9]+/[0-9]+ figures)' "$OUT/bench.log" | cut -c1-300
    fi
    echo "== files"
    (cd "$OUT" && ls -l | tail -n +2 | grep -v 'summary.txt.tmp$')
  } >"$OUT/summary.txt.tmp" 2>&1
  mv "$OUT/summary.txt.tmp" "$OUT/summary.txt"
}

finish() {
  local rc=$?
  trap - EXIT INT TERM
  [[ $FAILED -eq 0 && $SKIPPED -eq 0 && $rc -ne 0 ]] && FAILED=1
  local verdict=PASSED
  if [[ $FAILED -ne 0 ]]; then verdict=FAILED; elif [[ $SKIPPED -ne 0 ]]; then verdict=INCOMPLETE; fi
  note "END after $(elapsed) s: $verdict"
  write_summary
  rm -rf "$WORK"
  if [[ $FAILED -ne 0 ]]; then exit 1; elif [[ $SKIPPED -ne 0 ]]; then exit 2; fi
  exit 0
}
trap finish EXIT
trap 'note "INTERRUPTED after $(elapsed) s"; FAILED=1; exit 1' INT TERM

# run_step NAME BUDGET MIN LOG CMD...: CMD under `timeout` with BUDGET seconds (less when the
# deadline is nearer), output appended to LOG; skipped when fewer than MIN seconds are left.
# Returns CMD's status (124: timed out; 99: skipped).
run_step() {
  local name=$1 budget=$2 min=$3 log=$4
  shift 4
  local avail
  avail=$(left)
  if (( avail < min )); then
    note "SKIP    $name (${avail} s left, needs ${min} s)"
    SKIPPED=1
    write_summary
    return 99
  fi
  (( budget > avail )) && budget=$avail
  local t0=$SECONDS rc
  printf '\n### %s (limit %s s, at %s s)\n' "$name" "$budget" "$(elapsed)" >>"$log"
  timeout --signal=INT --kill-after=10 "$budget" "$@" >>"$log" 2>&1
  rc=$?
  local verdict=PASS
  if (( rc == 124 || rc == 137 )); then verdict=TIMEOUT; elif (( rc != 0 )); then verdict=FAIL; fi
  [[ $verdict != PASS ]] && FAILED=1
  note "$(printf '%-7s %s (rc %s, %s s)' "$verdict" "$name" "$rc" $(( SECONDS - t0 )))"
  if [[ $verdict != PASS ]]; then  # the step's last words, e.g. a traceback's last line
    tail -n 4 "$log" | cut -c1-240 | sed 's/^/        | /' >>"$WORK/steps.txt"
  fi
  write_summary
  return $rc
}

skip() {  # skip NAME WHY
  note "SKIP    $1 ($2)"
  SKIPPED=1
}

# ---- 1. facts -------------------------------------------------------------------------------
{
  echo "host: $(uname -srm), $(nproc) CPUs"
  if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
      --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: no nvidia-smi"
  fi
  echo "python: $("$PY" -V 2>&1) ($(command -v "$PY" || echo "$PY: not found"))"
  timeout 60 "$PY" -c "
import torch
print('torch:', torch.__version__, '| CUDA', torch.version.cuda, '| GPU available:',
      torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('device:', p.name, f'sm_{p.major}{p.minor},', p.multi_processor_count, 'SMs,',
          round(p.total_memory / 2**30), 'GiB')
" 2>&1 | tail -n 3 | sed 's/^/  /'
  echo "nvcc: $(nvcc --version 2>&1 | grep -E 'release' || echo 'not found')"
  echo "compute-sanitizer: $(compute-sanitizer --version 2>&1 | grep -iE 'version' | head -n 1 || echo 'not found')"
  echo "cmake: $(cmake --version 2>&1 | head -n 1) | ninja: $(ninja --version 2>&1 | head -n 1)"
  echo "arch list: $TORCH_CUDA_ARCH_LIST | deadline: $DEADLINE s"
} >>"$WORK/facts.txt" 2>&1
"$PY" -c "import torch" >/dev/null 2>&1 && HAVE_TORCH=1
[[ $HAVE_TORCH -eq 1 ]] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  >/dev/null 2>&1 && HAVE_GPU=1
note "PASS    facts (torch: $([[ $HAVE_TORCH -eq 1 ]] && echo yes || echo no), GPU: $([[ $HAVE_GPU -eq 1 ]] && echo yes || echo no), $(elapsed) s)"
write_summary

# ---- 2. build -------------------------------------------------------------------------------
build() {
  local args=(-m pip install --no-build-isolation --no-deps -v . -Cbuild-dir=build-gpu)
  "$PY" "${args[@]}" && return 0
  # A distribution's own Python refuses pip installs unless told otherwise (PEP 668).
  if grep -q externally-managed-environment "$OUT/build.log"; then
    "$PY" "${args[@]}" --break-system-packages && return 0
  fi
  return 1
}
check_import() {  # the installed build, imported from outside the source tree
  (cd "$RUN_DIR" && "$PY" -c "
import orca_ext, torch
print('orca_ext', orca_ext.__file__, '| has_cuda:', orca_ext.has_cuda())
assert orca_ext.has_cuda(), 'the installed orca_ext has no CUDA kernels'
")
}
if [[ $HAVE_TORCH -eq 0 ]]; then
  skip build "no torch for $PY"
else
  CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CUDA_FLAGS='-lineinfo --ptxas-options=-v'"
  if command -v ccache >/dev/null; then
    CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
  fi
  export CMAKE_ARGS ORCA_EXT_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  export -f build
  export PY OUT
  if run_step "build (ORCA_EXT_CUDA=ON, arch $TORCH_CUDA_ARCH_LIST, -lineinfo)" \
      "${ORCA_GPU_BUILD_BUDGET:-240}" 60 \
      "$OUT/build.log" bash -c build; then
    export -f check_import
    export RUN_DIR
    run_step "import the installed build" 60 10 "$OUT/build.log" bash -c check_import && BUILT=1
  fi
fi

cd "$RUN_DIR" || exit 1
export PYTHONDONTWRITEBYTECODE=1

# ---- 3. smoke: one case per kernel path; a poisoned context restarts after its case -----------
smoke_rounds() {
  local after="" rc round
  for round in 1 2 3 4; do
    if [[ -n "$after" ]]; then
      "$PY" "$ROOT/bench/cuda_smoke.py" --after "$after"
    else
      "$PY" "$ROOT/bench/cuda_smoke.py"
    fi
    rc=$?
    # After an abort the run has failed, whatever the rest gives.
    [[ $rc -ne 2 ]] && { [[ -n "$after" ]] && return 1; return $rc; }
    after=$(grep -E '^ABORT ' "$OUT/smoke.log" | tail -n 1 | cut -d' ' -f2)
    echo "(context poisoned after $after: a new process runs the rest)"
  done
  return 1
}

# ---- pytest with a per-test timeout and a restart after a poisoned context ------------------
cat >"$WORK/orca_gpu_plugin.py" <<'PYEOF'
"""Per-test timeout (SIGALRM), a record of finished tests (ORCA_DONE_FILE) that later runs
deselect, and a stop with status 3 once a failure has poisoned the CUDA context."""
import os
import signal

import pytest

DONE = os.environ["ORCA_DONE_FILE"]
LIMIT = float(os.environ.get("ORCA_TEST_TIMEOUT", "60"))


def _done():
    try:
        with open(DONE) as f:
            return {line.rstrip("\n") for line in f}
    except FileNotFoundError:
        return set()


def pytest_collection_modifyitems(config, items):
    done = _done()
    if done:
        keep = [i for i in items if i.nodeid not in done]
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in done])
        items[:] = keep


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout(f"test ran past {LIMIT:.0f} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _poisoned():
    try:
        import torch
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() != 2
    except Exception:  # noqa: BLE001
        return True


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        with open(DONE, "a") as f:
            f.write(report.nodeid + "\n")
    elif report.failed and report.when == "call" and _poisoned():
        with open(DONE, "a") as f:
            f.write(report.nodeid + "\n")
        pytest.exit(f"CUDA context poisoned after {report.nodeid}", returncode=3)
PYEOF

pytest_rounds() {  # pytest_rounds TIMEOUT_PER_TEST ARGS...: reruns the rest after status 3
  local per_test=$1 rc round
  shift
  local done_file
  done_file=$(mktemp "$WORK/done.XXXX")
  for round in 1 2 3; do
    ORCA_DONE_FILE=$done_file ORCA_TEST_TIMEOUT=$per_test PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" -m pytest -p orca_gpu_plugin -p no:cacheprovider -v -rfE --tb=short \
      --rootdir "$ROOT" "$@"
    rc=$?
    # After a poisoned context the run has failed, whatever the rest gives.
    [[ $rc -ne 3 ]] && { (( round > 1 )) && return 1; return $rc; }
    echo "(CUDA context poisoned: a new process runs the tests not yet run)"
  done
  return 1
}

sanitize_once() {  # sanitize_once TOOL OUTFILE [SMOKE ARGS...]: one process under the tool
  local run=(--tool "$1" --error-exitcode 9 --print-limit 30) out=$2
  shift 2
  local smoke=("$PY" "$ROOT/bench/cuda_smoke.py" --small "$@")
  local rc
  if compute-sanitizer --help 2>&1 | grep -q -- '--kernel-name'; then
    # Only our kernels instrumented (torch's run as they are): much faster.
    compute-sanitizer "${run[@]}" --kernel-name kns=orca "${smoke[@]}" 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    # A tool that refused the filter ran no case: run it again unfiltered.
    if (( rc == 0 )) || grep -qE '^(OK|FAIL|ABORT) ' "$out"; then return "$rc"; fi
    echo "(no case ran with --kernel-name kns=orca: again without the filter)"
  fi
  compute-sanitizer "${run[@]}" "${smoke[@]}" 2>&1 | tee "$out"
  return "${PIPESTATUS[0]}"
}

sanitizer() {  # sanitizer TOOL [SMOKE ARGS...]: the smoke's small cases; after an abort a new
  # process runs the rest
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1  # every allocation its own, so overruns are seen
  local tool=$1 out rc=0 status round after=()
  shift
  out=$(mktemp "$WORK/sanitizer.XXXX")
  for round in 1 2 3 4; do
    sanitize_once "$tool" "$out" "$@" "${after[@]}"
    status=$?
    (( status != 0 )) && rc=$status
    local aborted
    aborted=$(grep -E '^ABORT ' "$out" | tail -n 1 | cut -d' ' -f2)
    [[ -z "$aborted" ]] && return "$rc"
    echo "(context lost after $aborted: a new process runs the rest under $tool)"
    after=(--after "$aborted")
  done
  return 1
}

export -f smoke_rounds pytest_rounds sanitize_once sanitizer
export ROOT WORK

GPU_STEPS=(smoke memcheck racecheck synccheck "pytest test_cuda.py" "pytest test_ops.py -k cuda"
           "bench/ops_cuda.py --quick" "orca-tiny CUDA vs CPU")
if [[ $BUILT -eq 0 || $HAVE_GPU -eq 0 ]]; then
  why=$([[ $BUILT -eq 0 ]] && echo "no working build" || echo "no GPU")
  for s in "${GPU_STEPS[@]}"; do skip "$s" "$why"; done
  exit 0
fi

run_step "smoke: bench/cuda_smoke.py" 90 20 "$OUT/smoke.log" bash -c smoke_rounds
if command -v compute-sanitizer >/dev/null; then
  run_step "compute-sanitizer memcheck (smoke --small)" 75 25 "$OUT/sanitizer.log" \
    bash -c "sanitizer memcheck"
  # racecheck checks shared-memory hazards; on the H200 it stops with an internal error inside
  # cuBLAS's own GEMMs (torch's x @ w.t() alone trips it), and the cuBLAS cases' orca kernels
  # use no shared memory: those cases are left to memcheck and synccheck.
  run_step "compute-sanitizer racecheck (smoke --small --no-cublas)" 55 25 "$OUT/sanitizer.log" \
    bash -c "sanitizer racecheck --no-cublas"
  run_step "compute-sanitizer synccheck (smoke --small)" 45 25 "$OUT/sanitizer.log" \
    bash -c "sanitizer synccheck"
else
  for tool in memcheck racecheck synccheck; do skip "$tool" "no compute-sanitizer"; done
fi
run_step "pytest tests/test_cuda.py" 150 40 "$OUT/pytest.log" \
  bash -c "pytest_rounds 90 '$ROOT/tests/test_cuda.py'"
run_step "pytest tests/test_ops.py -k cuda" 60 20 "$OUT/pytest.log" \
  bash -c "pytest_rounds 30 '$ROOT/tests/test_ops.py' -k cuda"
run_step "bench/ops_cuda.py --quick" 75 30 "$OUT/bench.log" \
  "$PY" "$ROOT/bench/ops_cuda.py" --quick --out "$OUT/bench.json"
run_step "orca-tiny on CUDA vs CPU logits" 60 20 "$OUT/smoke.log" \
  "$PY" "$ROOT/bench/cuda_smoke.py" --model
exit 0
