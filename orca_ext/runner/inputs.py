"""A runner's copy of its requests, and one iteration's input tensors built from it.

The in-process runner and every distributed worker apply the same ``SchedulerOutput`` deltas to
an ``InputBatch`` and build the same tensors from it: the packed token ids, the attention
metadata (``kv.build_metadata`` over the block ids the runner holds) and the rows to sample.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..batch import ScheduledRequest, SchedulerOutput
from ..kv import build_metadata
from ..model.layers import AttentionMetadata
from ..sampling_params import SamplingParams


@dataclass(eq=False)
class RequestState:
    """What a runner holds of one request: its parameters, its KV blocks and every token it
    has run (the prompt, then the outputs), which the sampler's penalties read."""

    request_id: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_spec_tokens: int = 0  # the last token_ids are proposals being verified
    lora_slot: int = -1  # its LoRA adapter's slot (-1: the base model)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The outputs so far (proposals being verified are not outputs yet)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_spec_tokens]

    @property
    def spec_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens:]


@dataclass
class StepInputs:
    """One iteration's tensors (on the runner's device) and the requests it samples."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    # int64 [S]: the packed row of each sampled request's last token (and its proposals')
    sample_rows: torch.Tensor
    sampled: list[RequestState]
    is_decode: bool  # one new token per request, every request sampled
    speculative: bool = False  # some sampled request verifies proposals
    # int32 [B]: each request's LoRA adapter slot (-1: none); None when no request has one.
    lora_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def int64_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)`` through an array's buffer, which converts a
    decode step's few values with less overhead than torch.tensor's parsing of a list."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def packed_rows(requests: Sequence[ScheduledRequest]) -> tuple[list[int], list[int], list[int]]:
    """An iteration's packed token ids (padding included: it repeats the last token), each
    request's number of rows, and the rows sampled: each sampled request's last real token and
    the proposals after it."""
    token_ids: list[int] = []
    num_rows: list[int] = []
    sample_rows: list[int] = []
    for r in requests:
        token_ids.extend(r.token_ids)
        if r.num_padding:
            token_ids.extend(r.token_ids[-1:] * r.num_padding)
        num_rows.append(len(r.token_ids) + r.num_padding)
        if r.sample:
            last = len(token_ids) - r.num_padding
            sample_rows.extend(range(last - 1 - r.num_spec_tokens, last))
    return token_ids, num_rows, sample_rows


class InputBatch:
    """The requests a runner knows, kept current by each ``SchedulerOutput`` in batch order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[int, RequestState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the ended requests, add the new ones, apply each scheduled request's delta."""
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = RequestState(new.request_id, new.num_prompt_tokens,
                                                         new.sampling_params,
                                                         token_ids=list(new.computed_token_ids),
                                                         lora_slot=new.lora_slot)
        for r in scheduler_output.requests:
            state = self.requests[r.request_id]
            state.block_ids.extend(r.new_block_ids)
            if len(state.token_ids) != r.num_computed:
                del state.token_ids[r.num_computed:]  # a request-level row run again
            state.token_ids.extend(r.token_ids)
            state.num_spec_tokens = r.num_spec_tokens

    def prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """``update``, then the iteration's tensors, on the CPU."""
        self.update(scheduler_output)
        requests = scheduler_output.requests
        states = [self.requests[r.request_id] for r in requests]
        token_ids, num_rows, sample_rows = packed_rows(requests)
        cu_q_lens, context_lens, block_table, slot_mapping, positions = build_metadata(
            [s.block_ids for s in states], [r.num_computed for r in requests], num_rows,
            self.block_size)
        sampled = [s for s, r in zip(states, requests) if r.sample]
        lora_slots = None
        if any(s.lora_slot >= 0 for s in states):
            lora_slots = torch.tensor([s.lora_slot for s in states], dtype=torch.int32)
        return StepInputs(int64_tensor(token_ids), positions,
                          AttentionMetadata(cu_q_lens, context_lens, block_table, slot_mapping),
                          int64_tensor(sample_rows), sampled,
                          len(sampled) == len(requests) and len(token_ids) == len(requests),
                          len(sample_rows) > len(sampled), lora_slots)
