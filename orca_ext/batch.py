"""Plain data passed between the scheduler and the model executor (no tensors but a batch's
grammar masks).

One engine step is ``Scheduler.schedule() -> SchedulerOutput``, ``executor.execute(output) ->
RunnerOutput``, ``Scheduler.update(runner_output)``. A ``SchedulerOutput`` carries a new request's
data once and then only what changed (vLLM v1's scheme), so it stays small on the distributed
control plane; the runner keeps each request's state (``runner/inputs.py``). Request ids here are
the engine's internal integer ids; they are also the ids the C++ ``SlotAllocator`` knows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .structured import TokenBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen yet (new, or back after a preemption): what stays the
    same for its life, sent once. Its tokens are ``computed_token_ids`` then its
    ``ScheduledRequest.token_ids``; the first ``num_prompt_tokens`` of them are the prompt.
    ``computed_token_ids`` are the tokens whose KV its first blocks already hold (a prefix found
    in the prefix cache): the runner does not run them but keeps them in its token history, so
    the first ``ScheduledRequest.num_computed`` equals their number."""

    request_id: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    computed_token_ids: list[int] = field(default_factory=list)
    lora_int_id: int = 0  # its LoRA adapter (0: none), run in adapter slot lora_slot
    lora_slot: int = -1


@dataclass
class ScheduledRequest:
    """One request's share of an iteration, as a delta to what the runner already holds.

    ``token_ids`` are the tokens to run now (a whole prompt, a prompt chunk, or the last sampled
    token); they sit at positions ``num_computed .. num_computed + len(token_ids) - 1``.
    ``new_block_ids`` are the KV blocks given to the request since its last batch (all of them
    the first time). ``sample`` is False for a prompt chunk that is not the last one (its logits
    are not needed). ``num_padding`` tokens run after ``token_ids`` (request-level batching pads
    prompts to the batch's longest): their KV goes to the request's next slots, which its later
    tokens overwrite, and their outputs are dropped. The last ``num_spec_tokens`` of
    ``token_ids`` are speculative proposals (``spec_decode``): every one of the last
    ``1 + num_spec_tokens`` rows is sampled, and the runner accepts the proposals its samples
    confirm; the KV of the rejected ones is overwritten later.
    """

    request_id: int
    token_ids: list[int]
    num_computed: int
    new_block_ids: list[int] = field(default_factory=list)
    sample: bool = True
    num_padding: int = 0
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    """One batch, self-contained for a runner that has applied the batches before it:
    ``finished_request_ids`` first (requests that ended, were aborted or preempted since the
    last batch: the runner drops their state), then ``new_requests``, then ``requests``.
    ``token_bitmask`` holds the grammar masks of the constrained sampled requests, if any (the
    engine fills it in while the batch runs)."""

    batch_id: int
    requests: list[ScheduledRequest]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[int] = field(default_factory=list)
    token_bitmask: TokenBitmask | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) + r.num_padding for r in self.requests)


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token, and the top-n alternatives (token id -> logprob)."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RunnerOutput:
    batch_id: int
    # One entry per ScheduledRequest with sample=True, in the order of SchedulerOutput.requests.
    request_ids: list[int]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Speculative decoding: per request that verified proposals and accepted some, the tokens
    # after its first (the accepted proposals but the first, then the token sampled after the
    # last accepted one) and their logprobs.
    extra_token_ids: dict[int, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)
