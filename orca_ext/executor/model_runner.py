"""In-process executor: one SchedulerOutput in, one sampled token per request out."""
from __future__ import annotations

from array import array

import torch
from torch import nn

from ..batch import RunnerOutput, SchedulerOutput, packed_rows
from ..kv import SlotAllocator
from ..model.layers import AttentionMetadata
from ..sampling import Sampler
from .graph import trace_iteration
from .kv_cache import KVCache


# The RAII guard behind torch.inference_mode (enter / exit switch it on and back).
_InferenceMode = torch._C._InferenceMode


def int64_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)`` through an array's buffer: for a decode
    step's few values ~3x faster (~20 -> ~7 us, once the weight stream has evicted the caches;
    ad hoc, 2-core CPU)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


class ModelRunner:
    """Packs the scheduled requests' tokens, builds the iteration's attention metadata once
    (``allocator.build_metadata``), runs the model, and samples each request's last token.

    The scheduler owns the allocator's allocate/extend/free; the runner only reads it. On CPU
    the model's forward pass and logits replay from a TorchScript trace (``graph.py``) unless
    ``trace=False``; pass False for a model whose forward has Python side effects.
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, allocator: SlotAllocator,
                 sampler: Sampler | None = None, trace: bool | None = None) -> None:
        if (allocator.block_size != kv_cache.block_size
                or allocator.num_blocks > kv_cache.num_blocks):
            raise ValueError(f"allocator ({allocator.num_blocks} blocks of {allocator.block_size}) "
                             f"does not fit the KV cache ({kv_cache.num_blocks} blocks of "
                             f"{kv_cache.block_size})")
        self.model, self.kv_cache, self.allocator = model, kv_cache, allocator
        self.sampler = sampler or Sampler()
        self.device = kv_cache.device
        if trace is None:
            trace = self.device.type == "cpu"
        self.traced = trace_iteration(model, kv_cache) if trace else None

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        # Inference mode through torch's C++ guard, which torch.inference_mode wraps: as a
        # decorator it made a decode step of orca-tiny 7-107 us slower at batch 1-4 (ad hoc,
        # 2-core CPU: its Python frames run on caches the step's weight stream has evicted).
        with _InferenceMode(True):
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.sampler.drop(scheduler_output.finished_request_ids)
        requests = scheduler_output.requests
        sampled = [r for r in requests if r.sample]
        output = RunnerOutput(scheduler_output.batch_id, [r.request_id for r in sampled], [], [])
        if not requests:
            return output
        token_ids, num_rows, sample_rows = packed_rows(requests)
        host = (*self.allocator.build_metadata([r.request_id for r in requests],
                                               [r.num_computed for r in requests], num_rows),
                int64_tensor(token_ids), int64_tensor(sample_rows))
        # On CPU even a no-op .to() per tensor costs microseconds, once a decode step's weight
        # stream has evicted the caches.
        if self.device.type != "cpu":
            host = tuple(t.to(self.device, non_blocking=True) for t in host)
        cu_q_lens, context_lens, block_table, slot_mapping, positions, input_ids, indices = host
        meta = AttentionMetadata(cu_q_lens, context_lens, block_table, slot_mapping)
        if self.traced is not None:
            logits = self.traced(input_ids, positions, meta, indices)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
            logits = self.model.compute_logits(hidden, indices) if sampled else None
        if not sampled:
            return output
        result = self.sampler(logits, sampled)
        output.sampled_token_ids, output.logprobs = result.token_ids, result.logprobs
        return output
