"""Draft-model proposals: a second, smaller (or quantized) model sharing the target's vocabulary,
run greedily by its own ``ModelRunner`` over its own KV cache, one step per proposed token.

Each request's draft KV holds a prefix of its tokens: a step first runs the tokens the draft has
not seen (the prompt once, then the last accepted tokens) and proposes the argmax, then runs each
proposal to propose the next. The KV of proposals the target rejected is overwritten later: the
next step starts at the longest prefix the draft's tokens share with the request's.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..batch import NewRequestData, ScheduledRequest, SchedulerOutput
from ..kv import KVCache, SlotAllocator
from ..request import Request
from ..sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


def check_same_vocabulary(target_tokenizer, target_vocab: int, draft_tokenizer,
                          draft_vocab: int, draft_name: str) -> None:
    """ValueError naming the draft model when its vocabulary is not the target's."""
    if target_vocab != draft_vocab:
        raise ValueError(f"speculative_config.model: {draft_name!r} has a vocabulary of "
                         f"{draft_vocab} tokens, the target model {target_vocab}; a draft model "
                         "must share the target's tokenizer")
    target_inner = getattr(target_tokenizer, "inner", None)
    draft_inner = getattr(draft_tokenizer, "inner", None)
    if target_inner is not None and draft_inner is not None \
            and target_inner.get_vocab() != draft_inner.get_vocab():
        raise ValueError(f"speculative_config.model: {draft_name!r}'s tokenizer is not the "
                         "target model's (their vocabularies differ)")


class DraftModelProposer:
    """Greedy proposals of a draft ``runner`` (a ``ModelRunner`` over ``kv_cache``), whose KV
    slots ``allocator`` hands out per request."""

    def __init__(self, runner, allocator: SlotAllocator) -> None:
        self.runner, self.allocator = runner, allocator
        self._tokens: dict[int, list[int]] = {}  # per request: the tokens its draft KV holds
        self._sent_blocks: dict[int, int] = {}
        self._dropped: list[int] = []
        self._batch_id = 0

    def drop(self, request_ids: Iterable[int]) -> None:
        for request_id in request_ids:
            if self._tokens.pop(request_id, None) is not None:
                self.allocator.free(request_id)
                del self._sent_blocks[request_id]
                self._dropped.append(request_id)

    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        scheduled, new, rows = [], [], []
        for row, (request, k) in enumerate(requests):
            tokens = request.all_token_ids
            total = len(tokens) + k - 1  # its tokens and all proposals but the last
            known = self._tokens.get(request.request_id)
            if known is None:
                if not self.allocator.can_allocate(total):
                    continue  # the draft's KV is full: no proposals for it this step
                self.allocator.allocate(request.request_id, total)
                new.append(NewRequestData(request.request_id, len(request.prompt_token_ids),
                                          _GREEDY))
                known = self._tokens[request.request_id] = []
                self._sent_blocks[request.request_id] = 0
            elif not self._reserve(request.request_id, total):
                continue
            # At least the last token runs: its logits give the first proposal.
            start = min(_common_prefix(known, tokens), len(tokens) - 1)
            del known[start:]
            known.extend(tokens[start:])
            scheduled.append(ScheduledRequest(request.request_id, tokens[start:], start,
                                              self._new_blocks(request.request_id)))
            rows.append(row)
        while scheduled:  # one draft step per proposal position
            output = self.runner.execute(SchedulerOutput(self._batch_id, scheduled, new,
                                                         self._dropped))
            self._batch_id += 1
            new, self._dropped = [], []
            next_scheduled, next_rows = [], []
            for r, row, token in zip(scheduled, rows, output.sampled_token_ids):
                proposals[row].append(token)
                if len(proposals[row]) < requests[row][1]:
                    known = self._tokens[r.request_id]
                    next_scheduled.append(ScheduledRequest(r.request_id, [token], len(known)))
                    known.append(token)
                    next_rows.append(row)
            scheduled, rows = next_scheduled, next_rows
        return proposals

    def _reserve(self, request_id: int, total_tokens: int) -> bool:
        """Room in the draft's KV for ``total_tokens``; False (no proposals) when it is full."""
        need = total_tokens - self.allocator.capacity(request_id)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        self.allocator.extend(request_id, total_tokens)
        return True

    def _new_blocks(self, request_id: int) -> list[int]:
        blocks = self.allocator.blocks(request_id)
        sent = self._sent_blocks[request_id]
        self._sent_blocks[request_id] = len(blocks)
        return blocks[sent:]


def _common_prefix(known: list[int], tokens: list[int]) -> int:
    """Length of the common prefix of ``known`` and ``tokens`` (they differ only at the end)."""
    n = min(len(known), len(tokens))
    # The draft ran every token of the request before its last step's proposals.
    start = max(0, n - 64)
    if known[:start] != tokens[:start]:
        start = 0
    while start < n and known[start] == tokens[start]:
        start += 1
    return start


def build_draft_proposer(model_name: str, quantization: str | None, target, block_size: int,
                         num_kv_tokens: int) -> DraftModelProposer:
    """Load the draft model on the target's device and give it a KV cache of
    ``num_kv_tokens`` tokens (ValueError when its vocabulary is not ``target``'s, or its context
    is shorter)."""
    from ..model import load_model
    from ..model.dtypes import resolve_dtype
    from ..model.loader import runs_quantized
    from ..runner import ModelRunner

    device = target.device
    dtype = resolve_dtype("auto", device, runs_quantized(model_name, quantization, device))
    draft = load_model(model_name, dtype, str(device), quantization)
    check_same_vocabulary(target.tokenizer, target.config.vocab_size, draft.tokenizer,
                          draft.config.vocab_size, model_name)
    if draft.info.max_model_len < target.info.max_model_len:
        raise ValueError(f"speculative_config.model: {model_name!r} has a context of "
                         f"{draft.info.max_model_len} tokens, shorter than the target's "
                         f"{target.info.max_model_len} (set max_model_len)")
    num_blocks = -(-num_kv_tokens // block_size)
    kv_cache = KVCache(draft.config, num_blocks, block_size, draft.dtype, draft.device)
    return DraftModelProposer(ModelRunner(draft.model, kv_cache), SlotAllocator(num_blocks,
                                                                                block_size))
