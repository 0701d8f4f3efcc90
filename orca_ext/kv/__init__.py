"""The KV cache: the C++ slot allocator the scheduler keeps (``allocator``) and the per-layer
cache tensors the runner writes (``cache``)."""
from .allocator import KVCacheFullError, SlotAllocator, UnknownRequestError, build_metadata
from .cache import (KV_CACHE_DTYPES, KVCache, kv_bytes_per_block, num_kv_blocks, plan_kv_blocks,
                    resolve_kv_cache_dtype)

__all__ = ["KV_CACHE_DTYPES", "KVCache", "KVCacheFullError", "SlotAllocator", "UnknownRequestError",
           "build_metadata", "kv_bytes_per_block", "num_kv_blocks", "plan_kv_blocks",
           "resolve_kv_cache_dtype"]
