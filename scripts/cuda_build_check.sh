#!/usr/bin/env bash
# CI stage: compile and link the CUDA build of orca_ext on a machine without a GPU, import it and
# check that every op has a CUDA kernel registered.
#
#   scripts/cuda_build_check.sh
#
# Self-contained: creates $ORCA_CUDA_VENV (default .venv-cuda) with torch==2.14.1 (the CUDA 13.0
# build) and the build tools when it is missing, then builds into build-cuda/ with nvcc from PATH
# (or $CUDACXX / $CUDA_HOME), one GPU architecture ($TORCH_CUDA_ARCH_LIST, default 9.0) and
# ccache when installed. Exits non-zero on any failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VENV=${ORCA_CUDA_VENV:-$ROOT/.venv-cuda}
TORCH_SPEC=${ORCA_CUDA_TORCH:-torch==2.14.1}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
START=$(date +%s)

step() { printf '\n=== [cuda-build-check %3ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
fail() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }

step "toolchain"
NVCC=${CUDACXX:-$(command -v nvcc || true)}
if [[ -z "$NVCC" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then NVCC=$CUDA_HOME/bin/nvcc; fi
[[ -n "$NVCC" ]] || fail "nvcc not found (put the CUDA toolkit's bin/ on PATH or set CUDA_HOME)"
"$NVCC" --version | tail -n 2

if [[ ! -x "$VENV/bin/python" ]]; then
  step "creating $VENV with $TORCH_SPEC and the build tools (first run only, a few minutes)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "$TORCH_SPEC" "scikit-build-core>=0.10" "pybind11>=2.12" ninja \
    "cmake>=3.28" numpy pytest
fi
PY=$VENV/bin/python
"$PY" - <<'PYEOF' || fail "the venv's torch is not a CUDA build"
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU visible: {torch.cuda.is_available()}")
raise SystemExit(0 if torch.version.cuda else 1)
PYEOF

CMAKE_ARGS=${CMAKE_ARGS:-}
if command -v ccache >/dev/null; then
  CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
  ccache --zero-stats >/dev/null || true
else
  echo "note: ccache not installed; the build will not be cached (apt-get install -y ccache)"
fi
export CMAKE_ARGS

step "building the CUDA extension (ORCA_EXT_CUDA=ON, archs $TORCH_CUDA_ARCH_LIST) into build-cuda/"
LOG=$ROOT/build-cuda/build.log
mkdir -p "$ROOT/build-cuda"
if ! ORCA_EXT_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps -v . \
      -Cbuild-dir=build-cuda >"$LOG" 2>&1; then
  grep -E "error|Error|FAILED|orca_ext:" "$LOG" | head -n 60 >&2 || true
  fail "CUDA build failed (full log: $LOG)"
fi
grep -E "orca_ext:|Building CUDA|Linking" "$LOG" | sed 's/^ *//' || true
if command -v ccache >/dev/null; then ccache --show-stats 2>/dev/null | grep -E "Hits|Misses" | head -n 2 || true; fi

step "loading the extension (no GPU needed) and checking the CUDA kernel registrations"
# Loads the installed orca_ext/_C*.so directly (after torch), outside the source tree: this
# checks the compiled extension without needing the Python package's runtime dependencies.
(cd "$(mktemp -d)" && "$PY" - <<'PYEOF') || fail "load / registration check failed"
import glob, importlib.util, os, sysconfig
import torch

found = glob.glob(os.path.join(sysconfig.get_paths()["platlib"], "orca_ext", "_C*.so"))
assert found, "the installed orca_ext has no _C extension module"
spec = importlib.util.spec_from_file_location("orca_ext._C", found[0])
_C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_C)  # registers torch.ops.orca
print(f"  loaded {found[0]}")
assert _C.has_cuda(), "orca_ext._C was built without the CUDA kernels"
missing = []
for op in ("packed_linear", "logits_linear", "store_kv", "ragged_attention",
           "apply_token_bitmask", "lora_linear"):
    for key in ("CPU", "CUDA"):
        ok = torch._C._dispatch_has_kernel_for_dispatch_key(f"orca::{op}", key)
        print(f"  orca::{op:<17} {key:<5} kernel: {'yes' if ok else 'MISSING'}")
        if not ok:
            missing.append(f"{op}/{key}")
assert not missing, f"missing kernels: {missing}"
# The CPU kernels still work in the CUDA build.
x, w = torch.randn(3, 8), torch.randn(5, 8)
torch.testing.assert_close(torch.ops.orca.packed_linear(x, w, None, "none"), x @ w.T)
print(f"  CUDA available here: {torch.cuda.is_available()} (CUDA kernels compile-checked only)")
PYEOF

step "OK"
