"""What the driver and the workers send each other on the control plane (plain, picklable): the
``WorkerSpec`` once, then each batch's ``SchedulerOutput`` and ``RunnerOutput``, and ``STOP``.
"""
from __future__ import annotations

from dataclasses import dataclass

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
