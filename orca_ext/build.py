"""``build_engine``: an ``EngineConfig`` wired into an Engine (request -> scheduler -> runner ->
model -> ops), in this process or on distributed workers."""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import platform

from .config import EngineConfig
from .engine import Engine
from .scheduler import make_scheduler
from .spec_decode import make_speculator

_log = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> Engine:
    """Load the model and build allocator, KV cache, runner and scheduler into an Engine; with a
    distributed config, start the workers (``Engine.shutdown`` stops them)."""
    # Imported here so that ``import orca_ext`` stays light.
    from .kv import KVCache, SlotAllocator, kv_bytes_per_block, plan_kv_blocks
    from .model import load_model
    from .runner import ModelRunner

    if config.distributed:
        from .distributed import build_distributed_engine

        return build_distributed_engine(config)
    if isinstance(config.model, str):
        loaded = load_model(config.model, config.dtype, config.device, config.quantization)
    else:
        loaded = config.model
    loaded = with_context(loaded, config.max_model_len)
    kv_dtype = config.kv_dtype()
    num_blocks, why = plan_kv_blocks(loaded.config, config.block_size, kv_dtype,
                                     loaded.device, config.max_batch_size, loaded.max_model_len,
                                     config.kv_cache_tokens, config.kv_cache_memory)
    _log.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %.2f GiB: %s", num_blocks,
              config.block_size, num_blocks * config.block_size,
              str(kv_dtype).removeprefix("torch."),
              num_blocks * kv_bytes_per_block(loaded.config, config.block_size, kv_dtype)
              / 2**30, why)
    allocator = SlotAllocator(num_blocks, config.block_size)
    kv_cache = KVCache(loaded.config, num_blocks, config.block_size, kv_dtype, loaded.device)
    lora_manager = None
    if config.enable_lora:
        from .lora.manager import LoRAManager

        lora_manager = LoRAManager(loaded.model, config.max_loras, config.max_lora_rank,
                                   config.max_cpu_loras)
    runner = ModelRunner(loaded.model, kv_cache, lora_manager=lora_manager)
    speculator = make_speculator(config.speculative_config, loaded, config.block_size,
                                 num_blocks * config.block_size)
    engine = Engine(runner, make_scheduler(config.scheduler_config(), allocator, speculator),
                    max_model_len=loaded.max_model_len, tokenizer=loaded.tokenizer,
                    eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.config.vocab_size,
                    chat_template=loaded.chat_template, bos_token_id=loaded.config.bos_token_id,
                    eos_token_id=next(iter(loaded.config.eos_token_ids), None))
    if loaded.device.type == "cpu":
        _reuse_freed_memory()
    # The model, the tokenizer and the engine live long: collected once, then frozen out of the
    # cyclic collector's generations, whose passes then visit only the requests' objects.
    gc.collect()
    gc.freeze()
    return engine


def with_context(loaded, max_model_len: int | None):
    """``loaded`` (a LoadedModel or ModelInfo) with its context capped at ``max_model_len``;
    ValueError when that exceeds the model's."""
    if max_model_len is None:
        return loaded
    if max_model_len > loaded.max_model_len:
        raise ValueError(f"max_model_len {max_model_len} is longer than the model's context "
                         f"({loaded.max_model_len} tokens)")
    return dataclasses.replace(loaded, max_model_len=max_model_len)


def _reuse_freed_memory() -> None:
    """glibc gives each allocation above its mmap threshold (128 KiB at first) pages of its own
    and returns them on free, so every step's large activations fault in freshly zeroed pages:
    with the threshold at its most (32 MiB) and a trim threshold of 1 GiB, freed activations are
    reused instead. Nothing to do on other C libraries."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h's mallopt parameters
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)
