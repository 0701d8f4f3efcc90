"""What the driver and the workers send each other on the control plane (plain, picklable)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import SchedulerOutput

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


@dataclass
class StepMessage:
    """One batch's control message: the scheduler's plain data plus the iteration metadata the
    driver built once (``SlotAllocator.build_metadata``)."""

    batch: SchedulerOutput
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    cu_q_lens: torch.Tensor  # int32 [B+1]
    context_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    sample_rows: torch.Tensor  # int64 [S]: packed row of each sampled request's last token
