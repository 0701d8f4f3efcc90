"""KV slot allocator (C++) with prefix caching: see ``csrc/kv/slot_allocator.h`` and
docs/internals.md ("SlotAllocator", "Prefix caching")."""
from ._C import KVCacheFullError, SlotAllocator, UnknownRequestError

__all__ = ["KVCacheFullError", "SlotAllocator", "UnknownRequestError"]
