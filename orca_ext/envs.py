"""The environment variables orca_ext reads: each one's type, default and meaning, in one place.

vLLM's ``envs.py`` in small: ``envs.ORCA_CUDA_GRAPHS`` reads its variable when accessed, so a
value set later in the process (a test's ``monkeypatch.setenv``) is seen; no other module reads a
knob from ``os.environ``. The kernels' variables are read once, at their first use, by
``csrc/envs.h``:

- ``ORCA_QUANT_ISA`` (portable, avx2, avx512, avx512_vnni, amx_int8): the quantized linears'
  kernel path;
- ``ORCA_ATTENTION_ISA`` (portable, avx512bf16, amx): ragged_attention's bfloat16 prefill-like
  kernels;
- ``ORCA_LORA_ISA`` (portable, avx2, avx512): the LoRA kernels.

Unset or empty, each is the best path this build and CPU run; ``orca_ext._C.set_isa(kind, name)``
changes the choice for the rest of the process (``_C.get_isa(kind)`` names it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    ORCA_CUDA_GRAPHS: bool = True
    ORCA_API_KEY: str | None = None
    XDG_CACHE_HOME: Path = Path.home() / ".cache"

environment_variables: dict[str, Callable[[], Any]] = {
    # On CUDA, capture decode steps as CUDA graphs; "0" runs them eagerly.
    "ORCA_CUDA_GRAPHS": lambda: os.environ.get("ORCA_CUDA_GRAPHS", "1") != "0",
    # The API key orca-serve requires (Authorization: Bearer) unless --api-key says otherwise.
    "ORCA_API_KEY": lambda: os.environ.get("ORCA_API_KEY"),
    # The user cache's root, under which files made once are kept (default ~/.cache).
    "XDG_CACHE_HOME": lambda: Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
