"""What the driver and the workers send each other on the control plane (plain, picklable): the
``WorkerSpec`` once, then each batch's ``SchedulerOutput`` and ``RunnerOutput``, the LoRA
adapters added and removed (in order with the batches; no reply), and ``STOP``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lora.request import LoRARequest

STOP = "stop"  # sent down the pipeline to end the workers; the last stage echoes it back


@dataclass
class WorkerSpec:
    """What every worker needs to know, broadcast by the driver after the rendezvous."""

    model: str  # a built-in name or a model folder (the same path on every node)
    dtype: str
    device: str  # "cpu" or "cuda" (each worker takes cuda:<its index on its node>)
    tp: int
    pp: int
    stage_layers: list[tuple[int, int]]  # [start, stop) of each stage's layers
    num_blocks: int
    block_size: int
    # LoRA: (max_loras, max_lora_rank, max_cpu_loras), or None without enable_lora.
    lora: tuple[int, int, int] | None = None


@dataclass
class AddLoRA:
    """Every worker reads its share of ``request``'s adapter (the driver has checked it)."""

    request: LoRARequest


@dataclass
class RemoveLoRA:
    """Every worker forgets adapter ``lora_int_id`` (no unfinished request uses it)."""

    lora_int_id: int
