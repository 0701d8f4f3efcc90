"""Per-layer paged KV cache tensors, sized from a KV budget."""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from ..model.arena import huge_page_zeros
from ..model.config import ModelConfig

_log = logging.getLogger(__name__)

# The default KV cache: what max_batch_size full-context requests can use, capped at this many
# bytes (vLLM's CPU backend reserves 4 GiB by default) and at a share of the memory available.
DEFAULT_KV_CAP_BYTES = 4 * 2**30
DEFAULT_KV_SHARE = 0.5


# kv_cache_dtype names (vLLM's; "fp8" is its name for fp8_e4m3) and the cache dtype each gives;
# "auto" is the activations'.
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn}
# An int8 cache's row (one token's K or V of one KV head) ends in its float32 scale.
INT8_SCALE_BYTES = 4


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype,
                           device: torch.device | str) -> torch.dtype:
    """The KV cache's dtype for ``kv_cache_dtype`` with activations of ``dtype`` on ``device``:
    ``"auto"`` is ``dtype``; ``"int8"`` (per token and head scales) runs on CPU; ``"fp8_e4m3"``
    (or ``"fp8"``: float8 e4m3 values without a scale, saturated at +-448) on CUDA. ValueError
    naming the value for an unknown name or a combination that does not run."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of "
                         f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
    device_type = torch.device(device).type
    if kv_cache_dtype == "auto":
        return dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} needs float32, bfloat16 or "
                         f"float16 activations, got {dtype}")
    wanted = "cpu" if kv_cache_dtype == "int8" else "cuda"
    if device_type != wanted:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} runs on {wanted} only, got "
                         f"device {device_type!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a cache of ``dtype``: ``head_dim``, and for int8
    the row's float32 scale after its values."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (an int8 cache's scales too)."""
    return (2 * config.num_layers * block_size * config.num_kv_heads
            * kv_row_width(config.head_dim, dtype) * dtype.itemsize)


def num_kv_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_tokens: int | None = None, kv_cache_memory: int | None = None) -> int:
    """Blocks for a budget of ``kv_cache_tokens`` tokens (rounded up to whole blocks) or of
    ``kv_cache_memory`` bytes (rounded down); exactly one must be given."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if (kv_cache_tokens is None) == (kv_cache_memory is None):
        raise ValueError("give exactly one of kv_cache_tokens and kv_cache_memory, got "
                         f"kv_cache_tokens={kv_cache_tokens}, kv_cache_memory={kv_cache_memory}")
    if kv_cache_tokens is not None:
        if kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens}")
        return -(-kv_cache_tokens // block_size)
    per_block = kv_bytes_per_block(config, block_size, dtype)
    if kv_cache_memory < per_block:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes is less than one KV block "
                         f"({per_block} bytes at block_size={block_size}, {dtype})")
    return kv_cache_memory // per_block


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes free for new allocations: the GPU's free memory, or on a CPU MemAvailable (capped
    by a cgroup limit, where one is set); None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    available = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                      if line.startswith("MemAvailable:")), None)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text()
        except OSError:
            continue
        if limit.isdigit() and available is not None:
            available = min(available, int(limit) - int(usage))
    return available


def plan_kv_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype,
                   device: torch.device | str, max_batch_size: int, max_model_len: int,
                   kv_cache_tokens: int | None = None, kv_cache_memory: int | None = None,
                   caches_on_this_machine: int = 1) -> tuple[int, str]:
    """(blocks, why) for a KV cache. Without a budget: what ``max_batch_size`` full-context
    requests can use, capped at ``DEFAULT_KV_CAP_BYTES`` and at ``DEFAULT_KV_SHARE`` of the
    available memory (shared by ``caches_on_this_machine`` caches). An explicit budget larger
    than the available memory is a ValueError naming both, before anything is allocated."""
    per_block = kv_bytes_per_block(config, block_size, dtype)
    available = available_memory(device)
    if kv_cache_tokens is not None or kv_cache_memory is not None:
        blocks = num_kv_blocks(config, block_size, dtype, kv_cache_tokens, kv_cache_memory)
        wanted = blocks * per_block * caches_on_this_machine
        if available is not None and wanted > available:
            raise ValueError(f"the KV cache asked for ({blocks * block_size} tokens, "
                             f"{_gib(wanted)} GiB) is more than the {_gib(available)} GiB of "
                             f"memory available on {torch.device(device).type}")
        return blocks, "as asked"
    if max_batch_size < 1 or max_model_len < 1:
        raise ValueError(f"max_batch_size and max_model_len must be >= 1, got {max_batch_size} "
                         f"and {max_model_len}")
    full = num_kv_blocks(config, block_size, dtype, max_batch_size * max_model_len)
    cap = DEFAULT_KV_CAP_BYTES
    if available is not None:
        cap = min(cap, int(available * DEFAULT_KV_SHARE))
    cap_blocks = cap // caches_on_this_machine // per_block
    if full <= cap_blocks:
        return full, (f"{max_batch_size} requests x {max_model_len} tokens "
                      "(max_batch_size x context)")
    if cap_blocks < 1:
        raise ValueError(f"no room for a KV cache: {_gib(available or 0)} GiB of memory available,"
                         f" one block takes {per_block} bytes")
    source = (f"{DEFAULT_KV_SHARE:.0%} of the {_gib(available)} GiB available"
              if available is not None and cap < DEFAULT_KV_CAP_BYTES
              else f"the default cap of {_gib(DEFAULT_KV_CAP_BYTES)} GiB")
    return cap_blocks, (f"capped at {source} (max_batch_size x context would take "
                        f"{_gib(full * per_block * caches_on_this_machine)} GiB; set "
                        "kv_cache_tokens or kv_cache_memory to choose)")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


class KVCache:
    """``len(cache)`` layers; ``cache[i]`` is layer i's ``(k_cache, v_cache)``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (views of one zeroed allocation; on the
    CPU an anonymous mapping on huge pages, whose memory is taken as blocks are first written);
    ``keys`` / ``values`` list every layer's k / v cache. An int8 cache's rows are
    ``head_dim + 4`` bytes: the values (keys Walsh-Hadamard rotated, ``kv_int8.h``), then the
    row's float32 scale."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and "
                             f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                 kv_row_width(config.head_dim, dtype))
        nbytes = math.prod(shape) * dtype.itemsize
        if torch.device(device).type == "cpu":
            zeros = huge_page_zeros(nbytes)
        else:  # zeroed as bytes: a float8 cache has no fill kernel of its own to rely on
            zeros = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.storage = zeros.view(dtype).view(shape)
        self.layers = [(layer[0], layer[1]) for layer in self.storage]
        self.keys = [k for k, _ in self.layers]
        self.values = [v for _, v in self.layers]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.layers)
