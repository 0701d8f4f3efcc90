"""A linear's adapter slots and the step's per-request slots.

Every adaptable linear (``adapter.LORA_LINEARS``) gets a ``LinearLoRA``: float32 ``a [slots,
rank, in]`` and ``b_t [slots, rank, out]`` (rank = ``max_lora_rank`` x the linear's fused parts;
an adapter of lower rank leaves zero rows) on the model's device. All of them share one
``LoRABatch``: the slots' scales and, for the step running now, each request's slot and row range
(the attention metadata's ``cu_q_lens``), set once per step by the runner. A linear whose batch
has no adapter rows runs exactly as without LoRA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops


class LoRABatch:
    """The adapters of the step running now: ``seg_slots`` int32 ``[B]`` (-1: the base) over
    ``cu_seg_lens`` int32 ``[B + 1]``, or ``active`` False when no request of the step has one."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.active = False
        self.cu_seg_lens: torch.Tensor | None = None
        self.seg_slots: torch.Tensor | None = None

    def set(self, cu_seg_lens: torch.Tensor, seg_slots: torch.Tensor | None) -> None:
        self.active = seg_slots is not None
        self.cu_seg_lens, self.seg_slots = cu_seg_lens, seg_slots

    def clear(self) -> None:
        self.active, self.cu_seg_lens, self.seg_slots = False, None, None


def _activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """``packed_linear``'s epilogue activations, on the pre-activation ``y``."""
    if activation == "none":
        return y
    if activation in ops.GATED_ACTIVATIONS:
        gate, up = y.chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu_and_mul" else F.gelu(gate, approximate="tanh")
        return act * up
    return F.relu(y) if activation == "relu" else F.gelu(y, approximate="tanh")


class LinearLoRA:
    """One linear's adapter slots (plain tensors, not parameters: the checkpoint never has them)."""

    def __init__(self, batch: LoRABatch, num_slots: int, rank: int, in_features: int,
                 out_features: int, device: torch.device) -> None:
        self.batch = batch
        self.a = torch.zeros(num_slots, rank, in_features, device=device)
        self.b_t = torch.zeros(num_slots, rank, out_features, device=device)

    def forward(self, linear, x: torch.Tensor, residual: torch.Tensor | None,
                norm) -> torch.Tensor:
        """``linear(x, residual, norm)`` plus each adapter row's delta on ``norm(x)``, added
        before the activation (a gated MLP's gate and up rows each get theirs)."""
        batch = self.batch
        normed = x if norm is None else norm(x)
        if linear.activation == "none":
            y = linear.project(x, "none", residual, norm)
            ops.lora_linear(y, normed, self.a, self.b_t, batch.scales, batch.cu_seg_lens,
                            batch.seg_slots)
            return y
        y = linear.project(x, "none", None, norm)
        ops.lora_linear(y, normed, self.a, self.b_t, batch.scales, batch.cu_seg_lens,
                        batch.seg_slots)
        y = _activate(y, linear.activation)
        return y if residual is None else y + residual
