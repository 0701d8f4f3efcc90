"""Executors: the KV cache and the in-process ModelRunner."""
from .kv_cache import KVCache, kv_bytes_per_block, num_kv_blocks
from .model_runner import ModelRunner

__all__ = ["KVCache", "ModelRunner", "kv_bytes_per_block", "num_kv_blocks"]
