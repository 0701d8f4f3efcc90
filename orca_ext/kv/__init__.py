"""The KV cache: the C++ slot allocator the scheduler keeps (``allocator``) and the per-layer
cache tensors the runner writes (``cache``)."""
from .allocator import KVCacheFullError, SlotAllocator, UnknownRequestError, build_metadata
from .cache import KVCache, kv_bytes_per_block, num_kv_blocks, plan_kv_blocks

__all__ = ["KVCache", "KVCacheFullError", "SlotAllocator", "UnknownRequestError",
           "build_metadata", "kv_bytes_per_block", "num_kv_blocks", "plan_kv_blocks"]
