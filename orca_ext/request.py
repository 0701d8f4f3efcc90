"""One sequence as the scheduler sees it: token ids, progress, and why it ended."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    """A sequence to generate (one per sample: the engine expands ``n > 1`` into n of these).

    ``all_token_ids[:num_computed]`` have their KV stored; the rest are run next (the prompt or a
    prompt chunk, a whole recomputed sequence after preemption, or the last sampled token).
    ``max_new_tokens`` is ``max_tokens`` already capped by the context length, so a request's
    whole life needs at most ``max_total_tokens`` KV slots.
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed: int = 0
    in_flight: bool = False  # inside a batch the executor has not returned yet
    # KV blocks the runner has been told of; None: the runner does not know the request (it is
    # new, or was preempted and its state dropped).
    num_sent_blocks: int | None = None
    # Prefix caching: hashes of the full blocks of all_token_ids known so far (the prompt's at
    # arrival, then each block once its KV is computed); the prompt tokens reused from the
    # cache at the first admission (None until admitted).
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)
    lora_slot: int = -1  # the adapter slot it runs in while admitted (-1: none)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    # Speculative decoding: proposals to ask for next (None: the configured most), from the
    # decayed counts of its proposals accepted and checked (each up to the first rejected).
    num_spec_tokens: int | None = None
    spec_accepted: float = 0.0
    spec_checked: float = 0.0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> tuple[str, int | None] | None:
        """Record a sampled token; return ``(finish_reason, stop_reason)`` if it ends here."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if len(self.output_token_ids) >= self.max_new_tokens:
            return "length", None
        return None

    def truncate_output(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` outputs (a stop string or grammar ended the request
        inside a step's accepted speculative tokens)."""
        del self.output_token_ids[num_tokens:]
        del self.all_token_ids[len(self.prompt_token_ids) + num_tokens:]
