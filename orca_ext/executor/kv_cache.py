"""Per-layer paged KV cache tensors, sized from a KV budget."""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..model.arena import huge_page_empty
from ..model.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return (2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim
            * dtype.itemsize)


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


class KVCache:
    """``len(cache)`` layers; ``cache[i]`` is layer i's ``(k_cache, v_cache)``, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (views of one zeroed allocation, on
    huge pages on CPU)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and "
                             f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                 config.head_dim)
        if torch.device(device).type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            self.storage = huge_page_empty(nbytes).view(dtype).view(shape).zero_()
        else:
            self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(layer[0], layer[1]) for layer in self.storage]

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
