"""The activations' dtype: a name or ``"auto"`` resolved for the device and the CPU's
instructions."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

_log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """``"auto"`` or the dtype a name spells; a ValueError naming an unsupported one."""
    if dtype == "auto":
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    return dtype


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu",
                  quantized: bool = False) -> torch.dtype:
    """A dtype or its name; ``"auto"`` is bfloat16 on a GPU and on a CPU with native bfloat16
    matrix instructions (AMX or AVX512-BF16, which oneDNN runs torch's bfloat16 GEMMs on), float32
    on other CPUs, and float32 for a ``quantized`` model (as llama.cpp runs one)."""
    if dtype == "auto":
        return torch.float32 if quantized else auto_dtype(device)
    dtype = check_dtype(dtype)
    if quantized and dtype == torch.float16:
        raise ValueError("dtype: the quantized kernels take float32 or bfloat16 activations, not "
                         "float16 (or pass quantization='none')")
    return dtype


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX-BF16 or AVX512-BF16 (read from /proc/cpuinfo on Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    _log.info("dtype auto: %s (%s)", str(dtype).removeprefix("torch."),
              "the CPU has native bfloat16 matrix instructions" if dtype == torch.bfloat16
              else "the CPU has no AMX-BF16 or AVX512-BF16")
    return dtype
