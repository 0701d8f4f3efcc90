"""A distributed worker's share of an adapter: the layers of its pipeline stage, each linear's
low-rank pair split as the base linear is (vLLM's ``ColumnParallelLinearWithLoRA`` /
``RowParallelLinearWithLoRA``).

- Column-parallel linears (fused qkv, the MLP's up / gate-up) keep A whole and take B's columns
  (our ``b_t``, B transposed) for the output rows this rank holds, section by section, so a fused
  linear's q / k / v or gate / up parts split as the base weight's do.
- Row-parallel linears (attention output, MLP down) take A's input columns for the input features
  this rank holds and keep B whole: each rank adds ``scale * (x_local @ A_local^T) @ B^T`` to its
  partial sum before the all-reduce, and the ranks' deltas add up to the whole one.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..distributed.tensor_parallel import shard_ranges, tp_plan
from .adapter import LinearDelta, LoRAAdapter, load_adapter
from .request import LoRARequest


@dataclasses.dataclass(frozen=True)
class AdapterShard:
    """What one worker keeps of an adapter for ``reference`` (the whole model, its parameters on
    the meta device: it only gives the shapes adapters are checked against): global ``layers``
    (renumbered from 0, as the stage's model is), tensor-parallel shard ``tp_rank`` of ``tp``."""

    reference: nn.Module
    layers: range
    tp_rank: int = 0
    tp: int = 1

    def read(self, request: LoRARequest, max_rank: int) -> LoRAAdapter:
        """``request``'s adapter read from its files, checked against the whole model, and cut
        to this worker's share."""
        return self.take(load_adapter(request, self.reference, max_rank))

    def take(self, adapter: LoRAAdapter) -> LoRAAdapter:
        plan = tp_plan(self.reference.config)
        deltas: dict[str, LinearDelta] = {}
        for name, delta in adapter.deltas.items():
            layer, _, linear = name.removeprefix("layers.").partition(".")
            if int(layer) not in self.layers:
                continue
            a, b_t = delta.a, delta.b_t
            if self.tp > 1:
                split = plan[linear]
                ranges = shard_ranges(split, (b_t.shape[1], a.shape[1]), self.tp_rank, self.tp)
                if split.kind == "column":
                    b_t = torch.cat([b_t[:, start:stop] for start, stop in ranges.rows], dim=1)
                else:  # row
                    a = a[:, ranges.cols[0]:ranges.cols[1]]
            local = f"layers.{int(layer) - self.layers.start}.{linear}"
            deltas[local] = LinearDelta(a.contiguous(), b_t.contiguous())
        return dataclasses.replace(adapter, deltas=deltas)
