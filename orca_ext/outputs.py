"""What the engine returns to users (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One generated sequence (``index`` among the request's ``n``), cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless SamplingParams.logprobs is set
    # Per generated token: {token id: logprob} for the sampled token and the top alternatives.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's milestones."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens whose KV came from the prefix cache (the first sample's), as OpenAI's
    # usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int = 0
