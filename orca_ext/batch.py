"""Plain data passed between the scheduler and the model executor (no tensors).

One engine step is ``Scheduler.schedule() -> SchedulerOutput``, ``executor.execute(output) ->
RunnerOutput``, ``Scheduler.update(runner_output)``. Request ids here are the engine's internal
integer ids; they are also the ids the C++ ``SlotAllocator`` knows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of an iteration.

    ``token_ids`` are the tokens to run now (a whole prompt, a prompt chunk, or the last sampled
    token); they sit at positions ``num_computed .. num_computed + len(token_ids) - 1``. ``sample``
    is False for a prompt chunk that is not the last one (its logits are not needed).
    ``prompt_token_ids`` / ``output_token_ids`` are the request's own lists (read-only for the
    executor), used by the repetition/presence/frequency penalties. ``num_padding`` tokens run
    after ``token_ids`` (request-level batching pads prompts to the batch's longest): their KV
    goes to the request's next slots, which its later tokens overwrite, and their outputs are
    dropped.
    """

    request_id: int
    token_ids: list[int]
    num_computed: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sample: bool = True
    num_padding: int = 0


def packed_rows(requests: Sequence[ScheduledRequest]) -> tuple[list[int], list[int], list[int]]:
    """An iteration's packed token ids (padding included: it repeats the last token), each
    request's number of rows, and the row of each sampled request's last real token."""
    token_ids: list[int] = []
    num_rows: list[int] = []
    sample_rows: list[int] = []
    for r in requests:
        token_ids.extend(r.token_ids)
        if r.num_padding:
            token_ids.extend(r.token_ids[-1:] * r.num_padding)
        num_rows.append(len(r.token_ids) + r.num_padding)
        if r.sample:
            sample_rows.append(len(token_ids) - 1 - r.num_padding)
    return token_ids, num_rows, sample_rows


@dataclass
class SchedulerOutput:
    batch_id: int
    requests: list[ScheduledRequest]
    # Requests that ended (finished, aborted or preempted) since the last batch: the executor
    # drops any per-request state it keeps for them (e.g. seeded generators).
    finished_request_ids: list[int] = field(default_factory=list)

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
