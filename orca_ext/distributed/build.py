"""``build_distributed_executor``: the executor that runs the model on worker processes, for
``build_engine``."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..kv import SlotAllocator, plan_kv_blocks
from ..model.loader import ModelInfo, load_model_info
from ..spec_decode import Speculator, make_speculator
from .executor import DistributedExecutor
from .lora import DriverLoRA
from .messages import WorkerSpec
from .sharded_load import build_meta_model

if TYPE_CHECKING:
    from ..config import EngineConfig


def build_distributed_executor(config: EngineConfig
                               ) -> tuple[ModelInfo, DistributedExecutor, SlotAllocator,
                                          Speculator | None]:
    """The model's description, the executor on ``config.parallel_config``'s workers (this
    process is the driver: node 0), the KV allocator and the speculator of the engine
    ``config`` describes. ``kv_cache_memory`` is per worker; ``Engine.shutdown`` stops the
    workers."""
    parallel = config.parallel_config
    if parallel.node_rank != 0:
        raise ValueError("only node 0 runs the engine; other nodes run run_node()")
    device = config.device.split(":")[0]
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: distributed workers take 'cpu' or 'cuda' (each worker uses "
                         f"the GPU of its index on its node), got {config.device!r}")
    info = load_model_info(config.model).with_context(config.max_model_len)
    model_config = info.config
    parallel.check_model(model_config)
    stages = parallel.stage_layers(model_config.num_layers)
    tp = parallel.tensor_parallel_size
    widest = max(len(s) for s in stages)  # the KV cache of the stage with the most layers
    worker_config = dataclasses.replace(model_config, num_layers=widest,
                                        num_heads=model_config.num_heads // tp,
                                        num_kv_heads=model_config.num_kv_heads // tp,
                                        layer_types=model_config.layer_types[:widest])
    # On a CPU, this node's workers hold their caches in this machine's memory.
    local_caches = parallel.num_workers // parallel.nnodes if device == "cpu" else 1
    num_blocks, _ = plan_kv_blocks(worker_config, config.block_size, config.dtype, device,
                                   config.max_batch_size, info.max_model_len,
                                   config.kv_cache_tokens, config.kv_cache_memory, local_caches)
    lora = (config.max_loras, config.max_lora_rank, config.max_cpu_loras) \
        if config.enable_lora else None
    spec = WorkerSpec(config.model, str(config.dtype).removeprefix("torch."), device, tp,
                      parallel.pipeline_parallel_size, [(s.start, s.stop) for s in stages],
                      num_blocks, config.block_size, lora)
    executor = DistributedExecutor(parallel, spec, model_config)
    if config.enable_lora:
        reference = build_meta_model(model_config, config.dtype, "cpu")
        executor.lora_manager = DriverLoRA(reference, config.max_lora_rank,
                                           executor.send_control)
    speculator = make_speculator(config.speculative_config)  # n-gram: no model of its own
    return info, executor, SlotAllocator(num_blocks, config.block_size), speculator
