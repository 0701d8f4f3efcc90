"""A model's iteration (forward pass and logits) replayed from a TorchScript trace.

Run eagerly, every op of a decode step goes through the Python interpreter: ~100 calls of a
few microseconds each, slower still because the weights streaming through the caches evict
the interpreter's code and data between calls. The trace records the same ops once, with the
packed sizes kept symbolic (``x.shape[0]`` becomes a size op), and TorchScript's C++
interpreter replays them for any batch without the Python interpreter between ops.

The trace is of a function closing over the model, not of the model as a module: its weights
are then constants of the graph (references to the live parameter tensors, not copies, so an
in-place weight update still shows) instead of ~460 attribute lookups a step through the module
tree. The attention's reshapes are ``unflatten`` / ``flatten``, not views sized by
``x.shape[0]`` (each traced as a size op and a list op besides the view), which keeps the graph
small: orca-tiny's runs 95 nodes besides its constants.

Only for models whose forward is pure tensor code (GPT-2 and Llama here): Python side effects
such as the distributed wrappers' communication would not be recorded, so the distributed
workers run eagerly.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..model.layers import AttentionMetadata
from .fused import fused_forward
from .kv_cache import KVCache

logger = logging.getLogger(__name__)
# What torch.jit.optimized_execution toggles: whether the graph executor optimizes before running.
_get_optimize = torch._C._get_graph_executor_optimize
_set_optimize = torch._C._set_graph_executor_optimize


def _iteration(model: nn.Module) -> Callable[..., torch.Tensor]:
    """forward + compute_logits with every input a tensor (the KV caches as a flat list, so they
    stay inputs of the graph rather than constants); the blocks as one fused op where
    ``fused_forward`` applies."""
    forward = fused_forward(model) or model

    def run(input_ids: torch.Tensor, positions: torch.Tensor, cu_q_lens: torch.Tensor,
            context_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
            sample_rows: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        kv_caches = [(caches[i], caches[i + 1]) for i in range(0, len(caches), 2)]
        meta = AttentionMetadata(cu_q_lens, context_lens, block_table, slot_mapping)
        hidden = forward(input_ids, positions, kv_caches, meta)
        return model.compute_logits(hidden, sample_rows)

    return run


class TracedIteration:
    """``(input_ids, positions, meta, sample_rows) -> float32 logits [S, vocab]``, traced once
    on a dummy two-token request that stores nothing (slots -1)."""

    def __init__(self, model: nn.Module, kv_cache: KVCache) -> None:
        self.caches = [t for pair in kv_cache for t in pair]
        device = kv_cache.device
        int32 = {"dtype": torch.int32, "device": device}
        int64 = {"dtype": torch.int64, "device": device}
        example = (torch.zeros(2, **int64), torch.arange(2, **int64),
                   torch.tensor([0, 2], **int32), torch.tensor([2], **int32),
                   torch.zeros(1, 2, **int32), torch.full((2,), -1, **int64),
                   torch.tensor([1], **int64), self.caches)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # torch 2.13 marks jit.trace deprecated; where a later torch drops it, the runner
            # falls back to eager (trace_iteration).
            warnings.filterwarnings("ignore", r".*torch\.jit\.trace", DeprecationWarning)
            self.graph = torch.jit.trace(_iteration(model), example, check_trace=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_rows: torch.Tensor) -> torch.Tensor:
        # Plain interpretation: no profiling runs or graph passes specialized on a batch's sizes.
        # The executor's flag (per thread) is set around the call directly, not through
        # torch.jit.optimized_execution, a generator-based context manager whose Python frames
        # would run on cold caches every step.
        optimize = _get_optimize()
        _set_optimize(False)
        try:
            return self.graph(input_ids, positions, meta.cu_q_lens, meta.context_lens,
                              meta.block_table, meta.slot_mapping, sample_rows, self.caches)
        finally:
            _set_optimize(optimize)


def trace_iteration(model: nn.Module, kv_cache: KVCache) -> TracedIteration | None:
    """The traced iteration, or None (run eagerly) where the model cannot be traced."""
    try:
        return TracedIteration(model, kv_cache)
    except Exception as exc:  # noqa: BLE001 - any tracing failure means: run eagerly
        logger.warning("running %s eagerly: tracing its forward failed (%s)",
                       type(model).__name__, exc)
        return None
