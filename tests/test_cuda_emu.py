"""The CUDA kernels' device code, executed on the CPU.

tests/cuda_emu/emu_test.cpp compiles the torch-free kernel headers (csrc/include/orca/cuda/)
with the host C++ compiler against a SIMT emulation (tests/cuda_emu/orca_cuda_emulate.h: one OS
thread per CUDA thread, warp collectives - shuffles, ldmatrix, mma.sync m16n8k16 - computed as
the PTX ISA specifies, deferred cp.async, 16-byte alignment of cp.async / ldmatrix addresses
checked) and compares every attention path (tensor-core prefill and decode tiles, split-KV +
merge, the simple kernel), store_kv and the linear epilogue kernels with float64 references
(also on an fp8 e4m3 KV cache: attention over the cache's values, store_kv's rounding against
the nearest code); ``attention_items`` runs batches of over 128 requests on grids capped to a
few CTAs and checks that neither the grid nor a padded block table changes an output bit. This
checks indexing, fragment layouts, masking and the work partition on machines without a GPU; it
says nothing about speed. Needs the CUDA headers (cuda_bf16.h),
found through CUDA_HOME, nvcc or the pip nvidia packages; skipped without them.
ORCA_EMU_SANITIZE=1 (or ``address``) builds with AddressSanitizer/UBSan (slower), which also
turns the garbage-metadata cases into out-of-bounds checks; ORCA_EMU_SANITIZE=thread builds with
ThreadSanitizer, which reports shared-memory accesses of two emulated CUDA threads that no
barrier orders (a missing __syncthreads).
"""
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def cuda_include_dir() -> str | None:
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            info = subprocess.run([nvcc, "-v", "-E", "-x", "cu", os.devnull], capture_output=True,
                                  text=True, timeout=60).stderr
            top = re.search(r"^#\$ TOP=(.*)$", info, re.M)
            if top:
                candidates.append(os.path.join(os.path.realpath(top.group(1).strip()), "include"))
        except (OSError, subprocess.SubprocessError):
            pass
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                                       "include"))
    try:
        import nvidia  # pip CUDA packages next to a CUDA torch
        for base in nvidia.__path__:
            candidates += glob.glob(os.path.join(base, "*", "include"))
    except ImportError:
        pass
    candidates.append("/usr/local/cuda/include")
    for d in candidates:
        if os.path.exists(os.path.join(d, "cuda_bf16.h")) and \
                os.path.exists(os.path.join(d, "cuda_runtime.h")):
            return d
    return None


@pytest.fixture(scope="module")
def emu_binary(tmp_path_factory) -> Path:
    inc = cuda_include_dir()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if inc is None or cxx is None:
        pytest.skip("needs the CUDA headers (cuda_bf16.h) and a C++20 compiler")
    out = tmp_path_factory.mktemp("cuda_emu") / "emu_test"
    flags = ["-O1", "-pthread"]
    sanitize = os.environ.get("ORCA_EMU_SANITIZE", "")
    if sanitize in ("1", "address"):
        flags += ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    elif sanitize == "thread":
        flags += ["-g", "-fsanitize=thread"]
    elif sanitize not in ("", "0"):
        raise ValueError(f"ORCA_EMU_SANITIZE must be 1, address or thread, got {sanitize!r}")
    cmd = [cxx, "-std=c++20", *flags, "-DORCA_CUDA_EMULATE", f"-I{HERE / 'cuda_emu'}",
           f"-I{ROOT / 'csrc' / 'include'}", f"-I{inc}", str(HERE / "cuda_emu" / "emu_test.cpp"),
           "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"compiling the emulated kernels failed:\n{res.stderr[-6000:]}"
    return out


@pytest.mark.parametrize("suite", ["attention", "attention_items", "store_kv", "fp8", "linear",
                                   "lora"])
def test_cuda_kernels_emulated(emu_binary, suite):
    res = subprocess.run([str(emu_binary), suite], capture_output=True, text=True, timeout=1200)
    failures = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    assert res.returncode == 0 and not failures, (
        f"emulated CUDA kernels ({suite}) failed (rc {res.returncode}):\n"
        + "\n".join(failures) + "\n" + res.stdout[-3000:] + res.stderr[-3000:])
