"""The scheduler's side of speculative decoding: which requests get proposals and how many,
the proposer that makes them, each request's adaptive count, and the counters (vLLM's
``spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ..request import Request
from .config import SpeculativeConfig

# Weight of the latest step in a request's acceptance average.
_ACCEPTANCE_DECAY = 0.5


class Proposer(Protocol):
    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to ``k`` proposed next tokens per ``(request, k)``."""

    def drop(self, request_ids: Iterable[int]) -> None:
        """Forget ended (or preempted) requests."""


class Speculator:
    """Proposals for a batch's decoding requests, within ``max_batch_tokens`` in all; each
    request's count follows its acceptance: all of ``num_speculative_tokens`` after a step that
    accepted every proposal (copying goes on), else that many times its recent share of
    accepted proposals, at least one."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        # The engine's grammar check: how many of a constrained request's proposals its grammar
        # allows (None: no constrained requests).
        self.allowed_prefix: Callable[[Request, list[int]], int] | None = None
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether ``request``'s samples can be verified several at once: penalties and
        min_tokens depend on the outputs before each row, which proposals would change."""
        p = request.sampling_params
        penalised = p.repetition_penalty != 1 or p.presence_penalty != 0 \
            or p.frequency_penalty != 0
        return not penalised and len(request.output_token_ids) >= p.min_tokens

    def wanted(self, request: Request) -> int:
        return self.config.num_speculative_tokens if request.num_spec_tokens is None \
            else request.num_spec_tokens

    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        proposals = self.proposer.propose(requests)
        if self.allowed_prefix is not None:
            proposals = [p[:self.allowed_prefix(request, p)] if p else p
                         for (request, _), p in zip(requests, proposals)]
        return proposals

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Count one verification and adapt the request's next count."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        request.spec_acceptance += _ACCEPTANCE_DECAY * (num_accepted / num_proposed
                                                        - request.spec_acceptance)
        k_max = self.config.num_speculative_tokens
        request.num_spec_tokens = k_max if num_accepted == num_proposed \
            else max(1, min(k_max, round(k_max * request.spec_acceptance)))

    def drop(self, request_ids: Iterable[int]) -> None:
        self.proposer.drop(request_ids)
