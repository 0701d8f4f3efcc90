"""Iteration-level scheduling: Orca's Select and the policies behind one interface.

The scheduler moves request ids, token ids and KV block ids only, never tensors: each batch's
``SchedulerOutput`` tells the runner what changed (new requests once, then the tokens to run and
the blocks added), and the runner builds the tensors from its own copy.
Requests are served first-come first-served: every policy walks them in arrival order and stops
(never skips ahead) at the first one that does not fit, so a later request never overtakes.
With prefix caching (orca and paged), a request admitted with a cached prefix of full blocks
shares those blocks and starts with ``num_computed`` at the prefix's end; every full block whose
KV is computed is registered in the cache (docs/internals.md, "Prefix caching in the scheduler").
A waiting request whose next uncached block is one that a scheduled batch is computing waits for
that batch instead of computing the block again.
"""
from __future__ import annotations

import bisect
import sys
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .batch import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from .lora.slots import LoRASlots
from .request import Request

if TYPE_CHECKING:
    from .kv import SlotAllocator
    from .spec_decode import Speculator

# A request's share of a batch: the request and how many of its tokens run now.
Picked = list[tuple[Request, int]]


@dataclass
class SchedulerConfig:
    policy: str = "orca"  # "orca", "paged" or "request"
    max_batch_size: int = 32
    num_batches_in_flight: int = 1  # Orca's pipelining: batches handed out and not yet returned
    max_num_batched_tokens: int | None = None  # paged only: per-iteration budget (chunked prefill)
    enable_prefix_caching: bool = False  # orca and paged only
    prefix_cache_salt: int = 0  # the block hashes' extra_key: whatever else changes the KV
    max_loras: int = 0  # LoRA adapters a batch may use (0: LoRA off); orca and paged only
    # A debugging guard: every batch's KV writes checked against its requests' blocks (no
    # write into a cached, possibly shared block; SlotAllocator.check_rows) before it runs.
    check_kv_writes: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        for name in ("max_batch_size", "num_batches_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None:
            if self.policy != "paged":
                raise ValueError("max_num_batched_tokens needs policy='paged' (orca and request "
                                 "run each prompt whole)")
            if self.max_num_batched_tokens < 1:
                raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                                 f"{self.max_num_batched_tokens}")
        if self.enable_prefix_caching and self.policy == "request":
            raise ValueError("enable_prefix_caching needs policy 'orca' or 'paged', got "
                             "policy='request' (its padding and re-run finished rows write "
                             "into blocks a cache would share)")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_loras and self.policy == "request":
            raise ValueError("LoRA adapters need policy 'orca' or 'paged', got policy='request'")
        if not -2**63 <= self.prefix_cache_salt < 2**63:
            raise ValueError(f"prefix_cache_salt must fit in 64 signed bits, got "
                             f"{self.prefix_cache_salt}")


@dataclass
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_batches_in_flight: int
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int  # since start
    num_cached_blocks: int = 0  # blocks in the prefix cache (held or evictable)
    # Since start, as vLLM counts them: tokens of the requests admitted with caching on (their
    # prompts, and outputs when recomputed after a preemption), and of those, tokens reused.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_evictable_blocks: int = 0  # cached blocks no request holds (free, their KV kept)
    # Speculative decoding since start, as vLLM counts them: verifications, tokens proposed in
    # them, and of those, tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_usage(self) -> float:
        """The prefix cache's share of the KV pool."""
        return self.num_cached_blocks / self.num_blocks


class Scheduler:
    """The request pool and the batches in flight; a policy's ``_select`` picks each batch."""

    # True: the engine returns a finished request only once no request is running (the batch
    # has drained), as request-level batching does.
    holds_outputs = False

    def __init__(self, config: SchedulerConfig, allocator: SlotAllocator,
                 speculator: Speculator | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.speculator = speculator
        self.waiting: deque[Request] = deque()  # holding no KV, in arrival order
        self.running: list[Request] = []  # holding KV, in arrival order
        self.requests: dict[int, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self._batches: dict[int, Picked] = {}
        self._batch_spec: dict[int, dict[int, int]] = {}  # batch -> request -> proposals sent
        self._next_batch_id = 0
        self._ended: list[int] = []  # ids to report in the next batch's finished_request_ids
        # Prefix caching: hashes of the prompt blocks the batches in flight complete, per batch
        # and counted over all of them (registered when their batch returns).
        self._batch_hashes: dict[int, list[int]] = {}
        self._pending_hashes: Counter[int] = Counter()
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None

    @property
    def kv_capacity(self) -> int:
        return self.allocator.num_blocks * self.allocator.block_size

    @property
    def num_batches_in_flight(self) -> int:
        return len(self._batches)

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Reject a request that could never be admitted, even into an empty KV cache
        (``Engine.prepare`` asks, before ``add_request``)."""
        need = num_prompt_tokens + max_new_tokens
        if need > self.kv_capacity:
            raise ValueError(
                f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_new_tokens}) "
                f"= {need} tokens exceeds the whole KV cache ({self.kv_capacity} tokens)")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already scheduled")
        if request.lora_int_id and self.lora_slots is None:
            raise ValueError("a request with a LoRA adapter needs enable_lora")
        if self.config.enable_prefix_caching:
            request.block_hashes = self.allocator.block_hashes(
                request.prompt_token_ids, self._cache_key(request))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: int) -> None:
        """End a request; an unknown or already finished id is ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, "abort")

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``request`` (or relabel it if it has ended already) and free its KV, which a
        request inside a batch still running keeps until that batch returns."""
        ended = request.finished
        request.finish_reason, request.stop_reason = reason, stop_reason
        if not ended:
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            del self.requests[request.request_id]
            if not request.in_flight:
                self._release(request)

    def schedule(self) -> SchedulerOutput:
        """The next batch; it has no requests when nothing can run (or the pipeline is full)."""
        full = len(self._batches) >= self.config.num_batches_in_flight
        picked = [] if full else self._select()
        if not picked:
            return SchedulerOutput(self._next_batch_id, [])
        proposals = self._propose(picked) if self.speculator is not None else {}
        scheduled, new_requests = [], []
        block_size = self.allocator.block_size
        for request, num_new in picked:
            request.in_flight = True
            if request.num_sent_blocks is None:
                new_requests.append(NewRequestData(
                    request.request_id, len(request.prompt_token_ids), request.sampling_params,
                    request.all_token_ids[:request.num_computed], request.lora_int_id,
                    request.lora_slot))
                request.num_sent_blocks = 0
            num_blocks = self.allocator.capacity(request.request_id) // block_size
            new_block_ids = []
            if num_blocks > request.num_sent_blocks:
                new_block_ids = self.allocator.blocks(request.request_id)[request.num_sent_blocks:]
                request.num_sent_blocks = num_blocks
            start = request.num_computed
            spec = proposals.get(request.request_id, [])
            scheduled.append(ScheduledRequest(
                request.request_id, request.all_token_ids[start:start + num_new] + spec, start,
                new_block_ids, sample=start + num_new == request.num_tokens,
                num_padding=self._padding(request), num_spec_tokens=len(spec)))
        if self.config.check_kv_writes:
            self.allocator.check_rows([r.request_id for r in scheduled],
                                      [r.num_computed for r in scheduled],
                                      [len(r.token_ids) + r.num_padding for r in scheduled])
        output = SchedulerOutput(self._next_batch_id, scheduled, new_requests, self._ended)
        self._batches[output.batch_id] = picked
        if proposals:
            self._batch_spec[output.batch_id] = {i: len(p) for i, p in proposals.items()}
        if self.config.enable_prefix_caching:
            hashes = [h for request, num_new in picked
                      for h in self._completed_hashes(request, num_new)]
            self._batch_hashes[output.batch_id] = hashes
            self._pending_hashes.update(hashes)
        self._next_batch_id += 1
        self._ended = []
        return output

    def update(self, output: RunnerOutput) -> list[Request]:
        """Apply a returned batch; return the requests that got tokens (finished ones included,
        their KV already freed). A request that verified proposals gets each accepted one and
        the token after them; the KV of the accepted ones counts as computed."""
        picked = self._batches.pop(output.batch_id)
        num_proposed = self._batch_spec.pop(output.batch_id, {})
        for h in self._batch_hashes.pop(output.batch_id, []):
            self._pending_hashes[h] -= 1
            if not self._pending_hashes[h]:
                del self._pending_hashes[h]  # only the batches in flight stay counted
        sampled = dict(zip(output.request_ids, output.sampled_token_ids))
        updated = []
        for request, num_new in picked:
            request.in_flight = False
            if request.finished:  # aborted while its batch ran
                self._release(request)
                continue
            request.num_computed += num_new
            token_id = sampled.get(request.request_id)
            if token_id is None:  # a prompt chunk
                if self.config.enable_prefix_caching:
                    self._cache_computed_blocks(request, num_new)
                continue
            extra = output.extra_token_ids.get(request.request_id, ())
            if request.request_id in num_proposed:
                self.speculator.record(request, num_proposed[request.request_id], len(extra))
            stop = request.append_token(token_id)
            for token_id in extra:
                if stop is not None:
                    break
                request.num_computed += 1  # the accepted proposal's KV
                stop = request.append_token(token_id)
            if self.config.enable_prefix_caching:
                self._cache_computed_blocks(request, num_new + len(extra))
            if stop is not None:
                self.finish(request, *stop)
            updated.append(request)
        return updated

    def _propose(self, picked: Picked) -> dict[int, list[int]]:
        """Proposals for the decoding requests of ``picked``, within the speculator's and the
        batch's token budgets, each request's KV capacity and its remaining max_tokens (the
        proposals and the token after them must fit)."""
        speculator = self.speculator
        num_tokens = sum(num_new for _, num_new in picked)
        room = speculator.config.max_batch_tokens - num_tokens
        if self.config.max_num_batched_tokens is not None:
            room = min(room, self.config.max_num_batched_tokens - num_tokens)
        wanted = []
        for request, num_new in picked:
            if room <= 0:
                break
            if (num_new != 1 or request.finished or request.num_computed != request.num_tokens - 1
                    or not speculator.eligible(request)):
                continue
            k = min(speculator.wanted(request), room,
                    request.max_new_tokens - len(request.output_token_ids) - 1)
            k = min(k, self._spec_room(request, request.num_tokens + k) - request.num_tokens)
            if k > 0:
                wanted.append((request, k))
                room -= k
        if not wanted:
            return {}
        proposals = speculator.propose(wanted)
        return {request.request_id: p for (request, _), p in zip(wanted, proposals) if p}

    def _spec_room(self, request: Request, total_tokens: int) -> int:
        """KV slots ``request`` holds, grown towards ``total_tokens`` from free blocks (never
        by preempting): Orca's and request-level reservations already cover max_tokens."""
        capacity = self.allocator.capacity(request.request_id)
        need = total_tokens - capacity
        if need > 0 and self.allocator.can_allocate(need):
            self.allocator.extend(request.request_id, total_tokens)
            return total_tokens
        return capacity

    def stats(self) -> SchedulerStats:
        alloc = self.allocator
        caching = self.config.enable_prefix_caching
        return SchedulerStats(len(self.waiting), len(self.running), len(self._batches),
                              alloc.num_used_blocks, alloc.num_blocks, self.num_preemptions,
                              alloc.num_cached_blocks if caching else 0,
                              self.prefix_cache_queries, self.prefix_cache_hits,
                              alloc.num_evictable_blocks if caching else 0,
                              *((spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
                                if (spec := self.speculator) is not None else ()))

    def _select(self) -> Picked:
        raise NotImplementedError

    def _padding(self, request: Request) -> int:
        """Padding tokens to run after ``request``'s scheduled tokens (request-level only)."""
        return 0

    def _cache_key(self, request: Request) -> int:
        """The block hashes' extra key: the salt, mixed with the request's adapter load (a
        block's KV under adapter X is not the base's or adapter Y's, nor that of an adapter
        unloaded and replaced under X's id)."""
        salt = self.config.prefix_cache_salt
        if not request.lora_int_id:
            return salt
        token = self.lora_slots.load_token(request.lora_int_id)
        mixed = (salt ^ (token * 0x9E3779B97F4A7C15)) & (2**64 - 1)
        return mixed - 2**64 if mixed >= 2**63 else mixed

    def _prefix_hashes(self, request: Request) -> list[int]:
        """The hashes ``request`` may look up at admission: its full blocks before the one
        holding its last token (that token is always computed, for the logits)."""
        if not self.config.enable_prefix_caching:
            return []
        return request.block_hashes[:(request.num_tokens - 1) // self.allocator.block_size]

    def _completed_hashes(self, request: Request, num_new: int) -> list[int]:
        """Hashes of ``request``'s prompt blocks that become full when ``num_new`` more of its
        tokens run."""
        block_size = self.allocator.block_size
        return request.block_hashes[request.num_computed // block_size:
                                    (request.num_computed + num_new) // block_size]

    def _step_hashes(self, batch: Picked) -> set[int]:
        """Hashes of the prompt blocks the batch being picked completes."""
        if not self.config.enable_prefix_caching:
            return set()
        return {h for request, num_new in batch for h in self._completed_hashes(request, num_new)}

    def _waits_for_prefix(self, prefix_hashes: list[int], step_hashes: set[int]) -> bool:
        """True if the first uncached block of ``prefix_hashes`` is one that the batch being
        picked (``step_hashes``) or a batch in flight computes: the request then waits for it
        and reuses it rather than computing the same KV again (requests sharing a prompt that
        arrive together). That batch returns, so the wait ends."""
        if not prefix_hashes:
            return False
        hit = self.allocator.num_cached_prefix_blocks(prefix_hashes)
        if hit == len(prefix_hashes):
            return False
        return prefix_hashes[hit] in step_hashes or self._pending_hashes[prefix_hashes[hit]] > 0

    def _admit(self, request: Request, num_tokens: int, prefix_hashes: list[int]) -> bool:
        """Move the oldest waiting request to running with KV for ``num_tokens``, sharing the
        cached blocks of the longest cached prefix of ``prefix_hashes``, if it fits (KV, and a
        slot for its LoRA adapter); its ``num_computed`` starts at the tokens reused."""
        if request.lora_int_id and not self.lora_slots.can_acquire(request.lora_int_id):
            return False
        if not self.allocator.can_allocate(num_tokens, prefix_hashes):
            return False
        if request.lora_int_id:
            request.lora_slot = self.lora_slots.acquire(request.lora_int_id)
        request.num_computed = self.allocator.allocate(request.request_id, num_tokens,
                                                       prefix_hashes)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed
        if self.config.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += request.num_computed
        self.waiting.popleft()
        bisect.insort(self.running, request, key=lambda r: r.request_id)  # ids follow arrival
        return True

    def _cache_computed_blocks(self, request: Request, num_new: int) -> None:
        """Register ``request``'s full blocks whose KV is computed, after ``num_new`` more
        tokens were: prompt and output blocks alike (a next turn resending the answer hits)."""
        block_size = self.allocator.block_size
        num_full = request.num_computed // block_size
        if num_full == (request.num_computed - num_new) // block_size:
            return  # no block completed in this batch
        hashes = request.block_hashes
        if num_full > len(hashes):
            start = len(hashes) * block_size
            hashes.extend(self.allocator.block_hashes(
                request.all_token_ids[start:num_full * block_size],
                self._cache_key(request), hashes[-1] if hashes else None))
        self.allocator.cache_blocks(request.request_id, hashes[:num_full])

    def _release(self, request: Request) -> None:
        if request.request_id in self.allocator:
            self.allocator.free(request.request_id)
        self._release_lora_slot(request)
        self._ended.append(request.request_id)
        if self.speculator is not None:
            self.speculator.drop([request.request_id])

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1


class OrcaScheduler(Scheduler):
    """Orca's Select: a request reserves prompt + max_tokens slots at admission (the reservation
    is the allocation) and is never preempted; a prompt runs whole in its first iteration."""

    def _select(self) -> Picked:
        max_batch_size = self.config.max_batch_size
        batch = []
        for request in self.running:
            if request.in_flight:
                continue
            if len(batch) == max_batch_size:
                return batch
            batch.append((request, request.num_tokens - request.num_computed))
        step_hashes = self._step_hashes(batch)
        while self.waiting and len(batch) < max_batch_size:
            # The reservation counts only the blocks it newly takes: shared cached blocks stay
            # held by it until it ends, so no other request's end can starve it.
            request = self.waiting[0]
            prefix = self._prefix_hashes(request)
            if (self._waits_for_prefix(prefix, step_hashes)
                    or not self._admit(request, request.max_total_tokens, prefix)):
                break
            num_new = request.num_tokens - request.num_computed
            batch.append((request, num_new))
            step_hashes.update(self._completed_hashes(request, num_new))
        return batch


class RequestLevelScheduler(Scheduler):
    """Request-level batching as in Orca's baseline (FasterTransformer): a batch runs as a unit.

    A new batch is admitted only once every request of the previous one has finished. Its
    prompts run padded to the batch's longest (the padding stores KV into the request's next
    slots and is dropped), so each request reserves max(longest prompt, prompt + max_tokens)
    slots. A request that finishes early keeps its row until the batch drains: it recomputes its
    last token each iteration (the work a static batch wastes on finished rows; its result is
    dropped) and keeps its KV, and the engine returns its output only when the batch drains
    (``holds_outputs``).
    """

    holds_outputs = True

    def __init__(self, config: SchedulerConfig, allocator: SlotAllocator,
                 speculator: Speculator | None = None) -> None:
        super().__init__(config, allocator, speculator)
        self._finished_rows: list[Request] = []  # finished, held until the batch drains
        self._pad_to = 0  # the running batch's longest prompt

    def _select(self) -> Picked:
        if not self.running and not self._finished_rows:
            self._admit_batch()
        # A finished row runs its last token again at the same position (into its own slot).
        return ([(r, r.num_tokens - r.num_computed) for r in self.running if not r.in_flight]
                + [(r, 1) for r in self._finished_rows if not r.in_flight])

    def _admit_batch(self) -> None:
        """The longest run of waiting requests (FCFS, up to max_batch_size) whose padded
        reservations fit together."""
        block_size, batch, pad_to = self.allocator.block_size, [], 0

        def blocks(request: Request, pad: int) -> int:
            return -(-max(pad, request.max_total_tokens) // block_size)

        for request in self.waiting:
            if len(batch) == self.config.max_batch_size:
                break
            pad = max(pad_to, len(request.prompt_token_ids))
            if sum(blocks(r, pad) for r in [*batch, request]) > self.allocator.num_free_blocks:
                break
            batch.append(request)
            pad_to = pad
        for request in batch:
            self.allocator.allocate(request.request_id, max(pad_to, request.max_total_tokens))
            self.waiting.popleft()
            self.running.append(request)
        self._pad_to = pad_to

    def _padding(self, request: Request) -> int:
        return 0 if request.num_computed else self._pad_to - len(request.prompt_token_ids)

    def _release(self, request: Request) -> None:
        if self.running and request.finish_reason != "abort":
            if request not in self._finished_rows:
                self._finished_rows.append(request)
            return
        if request in self._finished_rows:
            self._finished_rows.remove(request)
        super()._release(request)
        if not self.running:  # the batch has drained: its held rows go
            for held in [r for r in self._finished_rows if not r.in_flight]:
                self._finished_rows.remove(held)
                super()._release(held)


class PagedScheduler(Scheduler):
    """KV blocks are allocated as tokens arrive; when they run out, the latest-arrived running
    request is preempted and later recomputed from its prompt and outputs. With a token budget,
    long prompts run in chunks."""

    def _select(self) -> Picked:
        max_batch_size = self.config.max_batch_size
        budget = self.config.max_num_batched_tokens or sys.maxsize
        preemptions = self.num_preemptions
        batch: Picked = []
        chosen: set[int] = set()
        i = 0
        while i < len(self.running):  # preemption removes requests from the tail as we go
            request = self.running[i]
            i += 1
            if request.in_flight:
                continue
            if len(batch) == max_batch_size or budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed, budget)
            if not self._grow(request, request.num_computed + num_new, chosen):
                break
            batch.append((request, num_new))
            chosen.add(request.request_id)
            budget -= num_new
        if self.num_preemptions != preemptions:
            return batch  # memory is short: let the running requests drain first
        block_size = self.allocator.block_size
        step_hashes = self._step_hashes(batch)
        while self.waiting and len(batch) < max_batch_size and budget > 0:
            request = self.waiting[0]
            prefix = self._prefix_hashes(request)
            if self._waits_for_prefix(prefix, step_hashes):
                break
            if prefix:
                prefix = prefix[:self.allocator.num_cached_prefix_blocks(prefix)]
            num_cached = len(prefix) * block_size  # reused tokens cost no budget
            num_new = min(request.num_tokens - num_cached, budget)
            if not self._admit(request, num_cached + num_new, prefix):
                break
            batch.append((request, num_new))
            budget -= num_new
            step_hashes.update(self._completed_hashes(request, num_new))
        return batch

    def _grow(self, request: Request, total_tokens: int, chosen: set[int]) -> bool:
        """Give ``request`` room for ``total_tokens``, preempting the latest-arrived requests not
        in this batch; False if it cannot run now: it was the latest itself (and is preempted),
        or the latest is in flight (its batch returns first). Preempting an older request in
        its place could livelock two requests that take turns in the pipeline."""
        while True:
            need = total_tokens - self.allocator.capacity(request.request_id)
            if need <= 0:
                return True
            if self.allocator.can_allocate(need):
                self.allocator.extend(request.request_id, total_tokens)
                return True
            victim = next(r for r in reversed(self.running) if r.request_id not in chosen)
            if victim.in_flight:
                return False
            self._preempt(victim)
            if victim is request:
                return False

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request.request_id)
        self._release_lora_slot(request)
        request.num_computed = 0
        request.num_sent_blocks = None
        self.running.remove(request)
        self.waiting.appendleft(request)  # victims go latest first, so arrival order holds
        self._ended.append(request.request_id)
        self.num_preemptions += 1
        if self.speculator is not None:
            self.speculator.drop([request.request_id])


POLICIES: dict[str, type[Scheduler]] = {
    "orca": OrcaScheduler, "paged": PagedScheduler, "request": RequestLevelScheduler}


def make_scheduler(config: SchedulerConfig, allocator: SlotAllocator,
                   speculator: Speculator | None = None) -> Scheduler:
    return POLICIES[config.policy](config, allocator, speculator)
