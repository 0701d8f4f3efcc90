"""In-process executor: one SchedulerOutput in, one sampled token per request out."""
from __future__ import annotations

from array import array

import torch
from torch import nn

from ..batch import RunnerOutput, SchedulerOutput, packed_rows
from ..kv import SlotAllocator
from ..model.layers import AttentionMetadata
from ..sampling import Sampler
from .cuda_graphs import DecodeGraphs, PinnedUpload, cuda_graphs_enabled
from .graph import trace_iteration
from .kv_cache import KVCache


# The RAII guard behind torch.inference_mode (enter / exit switch it on and back).
_InferenceMode = torch._C._InferenceMode


def int64_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)`` through an array's buffer, which converts a
    decode step's few values with less overhead than torch.tensor's parsing of a list."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


class ModelRunner:
    """Packs the scheduled requests' tokens, builds the iteration's attention metadata once
    (``allocator.build_metadata``), runs the model, and samples each request's last token.

    The scheduler owns the allocator's allocate/extend/free; the runner only reads it. On CPU
    the model's forward pass and logits replay from a TorchScript trace (``graph.py``) unless
    ``trace=False``; pass False for a model whose forward has Python side effects. On CUDA the
    metadata goes up in one transfer from pinned memory, and decode iterations replay from CUDA
    graphs (``cuda_graphs.py``) unless ``cuda_graphs=False`` or ``ORCA_CUDA_GRAPHS=0``;
    ``cuda_graph_max_context`` (default: the model's ``max_model_len``, at most the KV cache)
    bounds the contexts they take.
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, allocator: SlotAllocator,
                 sampler: Sampler | None = None, trace: bool | None = None,
                 cuda_graphs: bool | None = None,
                 cuda_graph_max_context: int | None = None) -> None:
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
        self.upload = self.graphs = None
        if self.device.type == "cuda":
            self.upload = PinnedUpload(self.device)
            if cuda_graphs_enabled(cuda_graphs):
                if cuda_graph_max_context is None:
                    config = getattr(model, "config", None)
                    cuda_graph_max_context = min(kv_cache.num_tokens,
                                                 getattr(config, "max_model_len", 1 << 30))
                self.graphs = DecodeGraphs(self._forward, kv_cache, cuda_graph_max_context)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, indices: torch.Tensor) -> torch.Tensor:
        """Logits of the packed rows ``indices`` (what a CUDA graph captures)."""
        if self.traced is not None:
            return self.traced(input_ids, positions, meta, indices)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden, indices)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        # Inference mode through torch's C++ guard, which torch.inference_mode wraps: the
        # decorator's Python frames would run on caches the step's weight stream has evicted.
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
        if self.upload is not None:  # CUDA
            logits = self._cuda_logits(requests, num_rows, len(sampled), host)
        else:
            # On CPU even a no-op .to() per tensor costs microseconds, once a decode step's
            # weight stream has evicted the caches.
            if self.device.type != "cpu":
                host = tuple(t.to(self.device, non_blocking=True) for t in host)
            logits = self._run(host, bool(sampled))
        if not sampled:
            return output
        result = self.sampler(logits, sampled)
        output.sampled_token_ids, output.logprobs = result.token_ids, result.logprobs
        return output

    def _cuda_logits(self, requests: list, num_rows: list[int], num_sampled: int,
                     host: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The iteration's logits on a GPU: a decode iteration from its bucket's CUDA graph,
        anything else eagerly after one pinned upload of the metadata."""
        if (self.graphs is not None and num_sampled == len(requests)
                and all(n == 1 for n in num_rows)):
            bucket = self.graphs.bucket(len(requests), max(r.num_computed for r in requests) + 1)
            if bucket is not None:
                _, context_lens, block_table, slot_mapping, positions, input_ids, _ = host
                return self.graphs.run(bucket, input_ids, positions, slot_mapping, context_lens,
                                       block_table)
        return self._run(self.upload(host), bool(num_sampled))

    def _run(self, inputs: tuple[torch.Tensor, ...], sampled: bool) -> torch.Tensor | None:
        """One eager (or traced) iteration on the metadata tensors ``inputs`` on the device;
        without sampled rows an untraced model skips the logits (a prompt chunk: KV only)."""
        cu_q_lens, context_lens, block_table, slot_mapping, positions, input_ids, indices = inputs
        meta = AttentionMetadata(cu_q_lens, context_lens, block_table, slot_mapping)
        if sampled or self.traced is not None:
            return self._forward(input_ids, positions, meta, indices)
        self.model(input_ids, positions, self.kv_cache, meta)
        return None
