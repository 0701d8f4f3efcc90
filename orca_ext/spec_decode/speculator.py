"""The scheduler's side of speculative decoding: which requests get proposals and how many,
the proposer that makes them, each request's adaptive count, and the counters (vLLM's
``spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ..request import Request
from .config import SpeculativeConfig

# Weight of the past in a request's acceptance averages, per verification.
_ACCEPTANCE_DECAY = 0.5
# A verified token's cost as a share of a one-token step's: the slope of a one-request decode
# step's time against its tokens (bench/speculative.py --crossover, bench/README.md).
MARGINAL_TOKEN_COST = 0.25


def best_num_proposals(acceptance: float, most: int) -> int:
    """The number of proposals (1 .. ``most``) that yields the most tokens per unit of step
    time, each proposal accepted with probability ``acceptance`` after the one before it."""
    best, best_rate, expected, accepted_all = 1, 0.0, 1.0, 1.0
    for k in range(1, most + 1):
        accepted_all *= acceptance
        expected += accepted_all  # 1 + acceptance + ... + acceptance^k tokens per step
        rate = expected / (1 + MARGINAL_TOKEN_COST * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class Proposer(Protocol):
    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to ``k`` proposed next tokens per ``(request, k)``."""

    def drop(self, request_ids: Iterable[int]) -> None:
        """Forget ended (or preempted) requests."""


class Speculator:
    """Proposals for a batch's decoding requests, within ``max_batch_tokens`` in all; each
    request's count (at most ``num_speculative_tokens``) follows its recent acceptance: after a
    rejection, the count ``best_num_proposals`` gives for the share of its proposals that
    passed (each checked only after the one before it passed); after a step that accepted them
    all, twice as many and one more (copying comes in runs)."""

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
        checked = num_accepted + (num_accepted < num_proposed)  # up to the first rejected
        request.spec_accepted = _ACCEPTANCE_DECAY * request.spec_accepted + num_accepted
        request.spec_checked = _ACCEPTANCE_DECAY * request.spec_checked + checked
        most = self.config.num_speculative_tokens
        if num_accepted == num_proposed:
            request.num_spec_tokens = min(most, 2 * self.wanted(request) + 1)
        else:
            request.num_spec_tokens = best_num_proposals(
                request.spec_accepted / request.spec_checked, most)

    def drop(self, request_ids: Iterable[int]) -> None:
        self.proposer.drop(request_ids)
