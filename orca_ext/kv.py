"""KV slot allocator (C++): see ``csrc/kv/slot_allocator.h`` and docs/internals.md."""
from ._C import KVCacheFullError, SlotAllocator, UnknownRequestError

__all__ = ["KVCacheFullError", "SlotAllocator", "UnknownRequestError"]
