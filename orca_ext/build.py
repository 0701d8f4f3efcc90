"""``build_engine``: an ``EngineConfig`` wired into an Engine (request -> scheduler -> executor ->
model -> ops): the one place an engine is built, its model run in this process or on
distributed workers."""
from __future__ import annotations

import ctypes
import gc
import logging
import platform
from typing import TYPE_CHECKING, Any

from .config import EngineConfig
from .engine import Engine
from .scheduler import make_scheduler

if TYPE_CHECKING:
    from .kv import SlotAllocator
    from .model import ModelInfo
    from .spec_decode import Speculator

_log = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> Engine:
    """Load the model (or start the distributed workers, which load it) and build allocator,
    KV cache, executor and scheduler into an Engine; ``engine.info`` describes the model and
    ``Engine.shutdown`` stops any workers."""
    config = config.resolved()
    if config.distributed:
        # Imported here so that ``import orca_ext`` stays light.
        from .distributed.build import build_distributed_executor

        info, executor, allocator, speculator = build_distributed_executor(config)
    else:
        info, executor, allocator, speculator = _build_local_executor(config)
    engine = Engine(executor, make_scheduler(config.scheduler_config(), allocator, speculator),
                    info)
    if config.device.startswith("cpu") and not config.distributed:
        _reuse_freed_memory()
    # The model, the tokenizer and the engine live long: the garbage of their build (the young
    # generations: a full pass would visit every imported module's objects too) collected, then
    # all frozen out of the cyclic collector's generations, whose passes then visit only the
    # requests' objects.
    gc.collect(1)
    gc.freeze()
    return engine


def _build_local_executor(config: EngineConfig
                          ) -> tuple[ModelInfo, Any, SlotAllocator, Speculator | None]:
    """The model loaded in this process, its runner, KV allocator and speculator."""
    from .kv import KVCache, SlotAllocator, kv_bytes_per_block, plan_kv_blocks
    from .model import load_model
    from .runner import ModelRunner
    from .spec_decode import make_speculator

    if isinstance(config.model, str):
        loaded = load_model(config.model, config.dtype, config.device, config.quantization)
    else:
        loaded = config.model
    loaded = loaded.with_context(config.max_model_len)
    info = loaded.info
    kv_dtype = config.kv_dtype()
    num_blocks, why = plan_kv_blocks(info.config, config.block_size, kv_dtype,
                                     loaded.device, config.max_batch_size, info.max_model_len,
                                     config.kv_cache_tokens, config.kv_cache_memory)
    _log.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %.2f GiB: %s", num_blocks,
              config.block_size, num_blocks * config.block_size,
              str(kv_dtype).removeprefix("torch."),
              num_blocks * kv_bytes_per_block(info.config, config.block_size, kv_dtype)
              / 2**30, why)
    allocator = SlotAllocator(num_blocks, config.block_size)
    kv_cache = KVCache(info.config, num_blocks, config.block_size, kv_dtype, loaded.device)
    lora_manager = None
    if config.enable_lora:
        from .lora.manager import LoRAManager

        lora_manager = LoRAManager(loaded.model, config.max_loras, config.max_lora_rank,
                                   config.max_cpu_loras)
    runner = ModelRunner(loaded.model, kv_cache, lora_manager=lora_manager)
    speculator = make_speculator(config.speculative_config, loaded, config.block_size,
                                 num_blocks * config.block_size)
    return info, runner, allocator, speculator


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
