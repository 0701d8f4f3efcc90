"""The model runner: one SchedulerOutput in, one sampled token per sampled request out."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..batch import RunnerOutput, SchedulerOutput
from ..kv import KVCache
from ..model.layers import AttentionMetadata
from ..sampling import Sampler
from ..structured import TokenBitmask
from .cuda_graphs import DecodeGraphs, PinnedUpload, cuda_graphs_enabled
from .decoder_stack import (build_decoder_stack, set_stack_lora, stack_forward, tp_group,
                            unsupported_reason)
from .inputs import InputBatch, StepInputs

if TYPE_CHECKING:
    from ..lora.manager import LoRAManager

_log = logging.getLogger(__name__)


class ModelRunner:
    """Keeps its requests' state (``InputBatch``), builds each iteration's tensors once, runs
    the model and samples each sampled request's last token.

    How a step runs is decided once, here, and logged. On the CPU, a step of up to
    ``DecoderStack.max_tokens()`` tokens runs the model's blocks as one prepared DecoderStack
    (``decoder_stack.py``) where the model's layout allows it (``decoder_stack=False`` turns it
    off); every other step runs the model's own forward. On CUDA the metadata goes up in one
    transfer from pinned memory, and decode iterations replay from CUDA graphs
    (``cuda_graphs.py``) unless ``cuda_graphs=False`` or ``ORCA_CUDA_GRAPHS=0``;
    ``cuda_graph_max_context`` (default: the model's ``max_model_len``, at most the KV cache)
    bounds the contexts they take.

    The distributed workers use the same runner for their stage's layers (``prepare``,
    ``forward``, ``logits``, ``sample``); ``execute`` is all four.
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, sampler: Sampler | None = None, *,
                 decoder_stack: bool = True, cuda_graphs: bool | None = None,
                 cuda_graph_max_context: int | None = None,
                 lora_manager: LoRAManager | None = None) -> None:
        self.model, self.kv_cache = model, kv_cache
        # Steps with adapter rows add their deltas in the DecoderStack, or in the model's own
        # forward (its linears) where the stack does not run the step.
        self.lora_manager = lora_manager
        self.sampler = sampler or Sampler()
        self.device = kv_cache.device
        self.inputs = InputBatch(kv_cache.block_size)
        self.stack, self.stack_max_tokens, self.tp_group = None, 0, None
        self.upload = self.graphs = None
        name = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        if self.device.type == "cpu":
            reason = unsupported_reason(model) if decoder_stack else "turned off"
            if reason is None:
                self.stack = build_decoder_stack(model)
                self.stack_max_tokens = self.stack.max_tokens()
                self.tp_group = tp_group(model)
                if lora_manager is not None:
                    set_stack_lora(self.stack, model, lora_manager.linears,
                                   lora_manager.batch.scales)
                how = ("one DecoderStack" if self.tp_group is None else
                       f"a DecoderStack, all-reducing across {self.tp_group.size} "
                       "tensor-parallel ranks after each half-layer")
                _log.info("steps of up to %d tokens run %s's %d blocks as %s; larger ones its "
                          "own forward", self.stack_max_tokens, name, self.stack.num_layers(),
                          how)
            else:
                _log.info("every step runs %s's own forward (no DecoderStack: %s)", name, reason)
        elif self.device.type == "cuda":
            self.upload = PinnedUpload(self.device)
            if cuda_graphs_enabled(cuda_graphs):
                if cuda_graph_max_context is None:
                    config = getattr(model, "config", None)
                    cuda_graph_max_context = min(kv_cache.num_tokens,
                                                 getattr(config, "max_model_len", 1 << 30))
                self.graphs = DecodeGraphs(self._logits_of, kv_cache, cuda_graph_max_context)
            _log.info("every step runs %s's own forward on %s; decode steps %s", name,
                      self.device, "from CUDA graphs" if self.graphs else "eagerly")

    # --- the steps of one iteration, shared with the distributed workers ----------------------

    def prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Apply the batch's deltas and build its tensors (on the CPU; ``to_device`` moves);
        fill the adapter slots its new requests use."""
        if self.lora_manager is not None:
            for new in scheduler_output.new_requests:
                if new.lora_int_id:
                    self.lora_manager.activate(new.lora_slot, new.lora_int_id)
        return self.inputs.prepare(scheduler_output)

    def to_device(self, inputs: StepInputs) -> StepInputs:
        if self.device.type == "cpu":
            return inputs
        meta = inputs.meta
        host = (inputs.input_ids, inputs.positions, meta.cu_q_lens, meta.context_lens,
                meta.block_table, meta.slot_mapping, inputs.sample_rows)
        if self.upload is not None:
            dev = self.upload(host)
        else:
            dev = [t.to(self.device, non_blocking=True) for t in host]
        input_ids, positions, cu_q_lens, context_lens, block_table, slot_mapping, rows = dev
        lora_slots = None if inputs.lora_slots is None else \
            inputs.lora_slots.to(self.device, non_blocking=True)
        return StepInputs(input_ids, positions,
                          AttentionMetadata(cu_q_lens, context_lens, block_table,
                                            slot_mapping), rows,
                          inputs.sampled, inputs.is_decode, inputs.speculative, lora_slots)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the model's (or this stage's) blocks."""
        fits_stack = self.stack is not None and inputs.num_tokens <= self.stack_max_tokens
        if inputs.lora_slots is not None and fits_stack:
            return stack_forward(self.model, self.stack, inputs.input_ids, inputs.positions,
                                 self.kv_cache, inputs.meta, self.tp_group, inputs.lora_slots)
        if inputs.lora_slots is not None:
            self.lora_manager.set_step(inputs.meta.cu_q_lens, inputs.lora_slots)
            try:
                return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
            finally:
                self.lora_manager.clear_step()
        if fits_stack:
            return stack_forward(self.model, self.stack, inputs.input_ids, inputs.positions,
                                 self.kv_cache, inputs.meta, self.tp_group)
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)

    def logits(self, inputs: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the sampled rows."""
        return self.model.compute_logits(hidden, inputs.sample_rows)

    def sample(self, inputs: StepInputs, logits: torch.Tensor, output: RunnerOutput,
               token_bitmask: TokenBitmask | None = None) -> RunnerOutput:
        if inputs.speculative:
            return self.sampler.verify(logits, inputs.sampled, output, token_bitmask)
        result = self.sampler(logits, inputs.sampled, token_bitmask)
        output.sampled_token_ids, output.logprobs = result.token_ids, result.logprobs
        return output

    # --- the whole iteration ------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        # The engine loops run inside torch.inference_mode; a direct caller may not.
        if torch.is_inference_mode_enabled():
            return self._execute(scheduler_output)
        with torch.inference_mode():
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.sampler.drop(scheduler_output.finished_request_ids)
        inputs = self.prepare(scheduler_output)
        output = RunnerOutput(scheduler_output.batch_id, [s.request_id for s in inputs.sampled],
                              [], [])
        if not scheduler_output.requests:
            return output
        logits = None
        if self.graphs is not None and inputs.is_decode and inputs.lora_slots is None:
            longest = int(inputs.meta.context_lens.max())
            bucket = self.graphs.bucket(len(inputs.sampled), longest)
            if bucket is not None:
                meta = inputs.meta
                logits = self.graphs.run(bucket, inputs.input_ids, inputs.positions,
                                         meta.slot_mapping, meta.context_lens, meta.block_table)
        if logits is None:
            inputs = self.to_device(inputs)
            hidden = self.forward(inputs)
            if not inputs.sampled:
                return output  # a prompt chunk: KV only
            logits = self.logits(inputs, hidden)
        return self.sample(inputs, logits, output, scheduler_output.token_bitmask)

    def _logits_of(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, indices: torch.Tensor) -> torch.Tensor:
        """Logits of the packed rows ``indices`` (what a CUDA graph captures)."""
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden, indices)
