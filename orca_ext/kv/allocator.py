"""KV slot allocator (C++) with prefix caching: see ``csrc/kv/slot_allocator.h`` and
docs/internals.md ("SlotAllocator", "Prefix caching").

``build_metadata`` turns each request's block ids into one iteration's attention metadata;
the runner calls it on its own copy of the block tables (``csrc/kv/metadata.h``).
"""
from .._C import KVCacheFullError, SlotAllocator, UnknownRequestError, build_metadata

__all__ = ["KVCacheFullError", "SlotAllocator", "UnknownRequestError", "build_metadata"]
