"""Scheduler unit tests: a fake runner, no model."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_fakes import ALLOCATORS, KVFakeRunner, _real_allocator, reference

from orca_ext.request import Request
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler

VOCAB = 95


class Harness:
    """A scheduler, an allocator and a fake runner, with every invariant checked each step."""

    def __init__(self, allocator_cls, policy="orca", num_blocks=64, block_size=4,
                 max_batch_size=8, num_batches_in_flight=1, max_num_batched_tokens=None,
                 prefix_caching=False):
        self.allocator = allocator_cls(num_blocks, block_size)
        # The real allocator checks every batch's KV writes (the fake has no check_rows).
        self.config = SchedulerConfig(policy, max_batch_size, num_batches_in_flight,
                                      max_num_batched_tokens, prefix_caching,
                                      check_kv_writes=hasattr(self.allocator, "check_rows"))
        self.scheduler = make_scheduler(self.config, self.allocator)
        self.runner = KVFakeRunner(self.allocator, VOCAB)
        self.requests: list[Request] = []  # in arrival order (= id order)
        self.iterations: dict[int, int] = {}
        self.pending = deque()
        self.steps = 0

    def add(self, prompt_len: int, max_tokens: int, prompt: list[int] | None = None) -> Request:
        """A request for ``prompt`` (default: ``prompt_len`` tokens of its own)."""
        rid = len(self.requests)
        if prompt is None:
            prompt = [(rid * 13 + i) % VOCAB for i in range(prompt_len)]
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                          max_tokens)
        self.scheduler.add_request(request)
        self.requests.append(request)
        self.iterations[rid] = 0
        return request

    def step(self) -> list[Request]:
        self.steps += 1
        while len(self.pending) < self.config.num_batches_in_flight:
            out = self.scheduler.schedule()
            if not out.requests:
                break
            self._check_batch(out)
            self.pending.append(out)
        if not self.pending:
            return []
        updated = self.scheduler.update(self.runner.execute(self.pending.popleft()))
        self._check_state()
        return updated

    def run(self, max_steps: int = 10_000) -> None:
        while self.scheduler.requests or self.pending:
            self.step()
            assert self.steps < max_steps, "no progress"

    def _check_batch(self, out) -> None:
        ids = [r.request_id for r in out.requests]
        assert 0 < len(ids) <= self.config.max_batch_size
        assert len(set(ids)) == len(ids)
        in_flight = {r.request_id for batch in self.pending for r in batch.requests}
        assert not in_flight & set(ids), "a request inside an in-flight batch was selected again"
        if self.config.max_num_batched_tokens is not None:
            assert out.num_tokens <= self.config.max_num_batched_tokens
        if self.config.policy == "orca":  # a prompt (past its cached prefix) runs whole, at once
            for r in out.requests:
                request = self.scheduler.requests[r.request_id]
                prompt = request.prompt_token_ids
                assert (r.num_computed + len(r.token_ids) > len(prompt)
                        or r.token_ids == prompt[r.num_computed:])
        for r in out.requests:  # at least one token computed: a cached prefix stops before it
            assert r.token_ids and r.num_computed < self.requests[r.request_id].num_tokens
        for r in out.requests:
            self.iterations[r.request_id] += 1

    def _check_state(self) -> None:
        alloc, sched = self.allocator, self.scheduler
        assert alloc.num_used_blocks + alloc.num_free_blocks == alloc.num_blocks
        holders = [r for r in sched.running]
        blocks = [b for r in holders for b in alloc.blocks(r.request_id)]
        if self.config.enable_prefix_caching:  # only read-only cached prefix blocks are shared
            alloc.check_invariants()
            read_only = {b for r in holders for b in
                         alloc.blocks(r.request_id)[:alloc.shared_prefix_blocks(r.request_id)]}
            assert {b for b in blocks if blocks.count(b) > 1} <= read_only
            assert len(set(blocks)) == alloc.num_used_blocks
        else:
            assert len(blocks) == len(set(blocks)), "a block is held by two requests"
        assert all(r.request_id not in alloc for r in sched.waiting)
        if self.config.policy in ("orca", "request"):  # n_rsrv <= n_slots, in whole blocks
            assert sched.num_preemptions == 0
            bs = alloc.block_size
            # What each request newly reserved: shared blocks count once.
            n_rsrv = len(set(blocks)) * bs
            assert n_rsrv <= alloc.num_blocks * bs
            for r in holders:  # never starved: it holds all it will need
                assert alloc.capacity(r.request_id) >= r.max_total_tokens
        if self.config.num_batches_in_flight == 1:  # FCFS: earlier never ran fewer iterations
            live = [self.iterations[r.request_id] for r in self.requests if not r.finished]
            assert all(a >= b for a, b in zip(live, live[1:])), live

    def check_outputs(self) -> None:
        for r in self.requests:
            if r.finish_reason != "abort":
                assert r.output_token_ids == reference(r.prompt_token_ids, r.max_new_tokens, VOCAB)
        assert self.allocator.num_used_blocks == 0
        assert self.allocator.num_requests == 0
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        if self.config.enable_prefix_caching:
            self.allocator.check_invariants()
            assert all(self.allocator.ref_count(b) == 0
                       for b in range(self.allocator.num_blocks))


@pytest.fixture(params=ALLOCATORS)
def allocator_cls(request):
    return request.param()


def first_iteration(h: Harness, rid: int) -> int:
    return next(i for i, b in enumerate(h.runner.batches)
                if rid in [r.request_id for r in b.requests])


def last_iteration(h: Harness, rid: int) -> int:
    return max(i for i, b in enumerate(h.runner.batches)
               if rid in [r.request_id for r in b.requests])


@pytest.mark.parametrize("limit", ["batch_size", "kv"])
def test_late_join_early_finish(allocator_cls, limit):
    """A needs 100 tokens, B 20, C arrives after 10 iterations: under orca C takes B's place
    as soon as B finishes; under request-level batching it waits for A."""
    results = {}
    for policy in ("orca", "request"):
        kw = (dict(max_batch_size=2, num_blocks=64) if limit == "batch_size"
              else dict(max_batch_size=8, num_blocks=34))  # room for exactly two requests
        h = Harness(allocator_cls, policy, block_size=4, **kw)
        a, b = h.add(8, 100), h.add(8, 20)
        for _ in range(10):
            h.step()
        c = h.add(8, 20)
        h.run()
        h.check_outputs()
        results[policy] = (first_iteration(h, c.request_id), last_iteration(h, b.request_id),
                           last_iteration(h, a.request_id))
    c_start, b_end, a_end = results["orca"]
    assert c_start == b_end + 1
    c_start, b_end, a_end = results["request"]
    assert c_start == a_end + 1


def test_orca_reserves_at_admission_and_breaks(allocator_cls):
    """FCFS break: a big request that does not fit blocks smaller later ones."""
    h = Harness(allocator_cls, "orca", num_blocks=10, block_size=4, max_batch_size=8)
    h.add(4, 20)  # 6 blocks
    h.add(4, 20)  # 6 blocks: does not fit next to the first
    h.add(1, 1)  # 1 block: would fit, but must not overtake
    out = h.scheduler.schedule()
    assert [r.request_id for r in out.requests] == [0]
    assert h.allocator.capacity(0) >= 24 and h.allocator.num_used_blocks == 6
    h.pending.append(out)
    h.run()
    h.check_outputs()


def test_max_batch_size(allocator_cls):
    h = Harness(allocator_cls, "orca", max_batch_size=3, num_blocks=200)
    for i in range(10):
        h.add(5 + i, 7)
    h.run()
    h.check_outputs()
    assert max(len(b.requests) for b in h.runner.batches) == 3


def test_paged_preempts_latest_and_recomputes(allocator_cls):
    # 12 blocks of 4: both prompts fit (3 blocks each), their growth to 40 tokens does not.
    h = Harness(allocator_cls, "paged", num_blocks=12, block_size=4, max_batch_size=4)
    first, second = h.add(10, 30), h.add(10, 30)
    h.run()
    h.check_outputs()
    assert h.scheduler.num_preemptions > 0
    assert last_iteration(h, first.request_id) < last_iteration(h, second.request_id)
    recomputed = [r for b in h.runner.batches for r in b.requests
                  if r.request_id == second.request_id and r.num_computed == 0]
    assert len(recomputed) >= 2 and len(recomputed[-1].token_ids) > 10
    ended = [rid for b in h.runner.batches for rid in b.finished_request_ids]
    assert second.request_id in ended


def test_paged_pipeline_makes_progress(allocator_cls):
    """Found by hypothesis: two requests that each need the whole cache, two batches in flight
    of one request each. The older one used to preempt itself whenever the younger was in
    flight, and the two took turns forever; now it waits for that batch instead."""
    h = Harness(allocator_cls, "paged", num_blocks=3, block_size=16, max_batch_size=1,
                num_batches_in_flight=2, max_num_batched_tokens=4)
    h.add(1, 3)
    h.step()
    h.add(23, 11)
    h.add(23, 11)
    h.step()
    h.run(max_steps=500)
    h.check_outputs()


def test_paged_chunked_prefill(allocator_cls):
    h = Harness(allocator_cls, "paged", num_blocks=64, block_size=4,
                max_num_batched_tokens=16)
    h.add(50, 5)
    h.add(3, 5)
    h.run()
    h.check_outputs()
    chunks = [r for b in h.runner.batches for r in b.requests if r.request_id == 0]
    assert [len(r.token_ids) for r in chunks[:4]] == [16, 16, 16, 2]
    assert [r.sample for r in chunks[:4]] == [False, False, False, True]


@pytest.mark.parametrize("policy", ["orca", "paged", "request"])
def test_abort_frees_kv(allocator_cls, policy):
    h = Harness(allocator_cls, policy)
    h.add(10, 50)
    h.add(10, 50)
    h.add(10, 50)
    for _ in range(3):
        h.step()
    assert h.allocator.num_used_blocks > 0
    h.scheduler.abort(1)  # running
    h.scheduler.abort(2)  # running or waiting
    h.scheduler.abort(99)  # unknown: ignored
    assert 1 not in h.allocator and 2 not in h.allocator
    out = h.scheduler.schedule()  # the aborted ids are reported to the executor
    assert {1, 2} <= set(out.finished_request_ids)
    assert [r.request_id for r in out.requests] == [0]
    h.scheduler.abort(0)  # in flight: its KV stays until the batch returns
    assert 0 in h.allocator
    h.scheduler.update(h.runner.execute(out))
    assert h.allocator.num_used_blocks == 0 and not h.scheduler.requests
    assert h.requests[0].finish_reason == "abort"


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_pipelined_batches(allocator_cls, policy):
    h = Harness(allocator_cls, policy, num_batches_in_flight=2, max_batch_size=3)
    for i in range(8):
        h.add(3 + i, 6 + i)
    h.run()
    h.check_outputs()


def test_request_that_can_never_fit(allocator_cls):
    """``check_fits`` (asked once, by ``Engine.prepare``, before ``add_request``) refuses what
    even an empty pool cannot hold."""
    h = Harness(allocator_cls, "paged", num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"max_tokens: prompt \(10 tokens\) \+ max_tokens "
                                         r"\(7\) = 17 tokens exceeds the whole KV cache "
                                         r"\(16 tokens\)"):
        h.scheduler.check_fits(10, 7)
    h.scheduler.check_fits(10, 6)
    h.add(10, 6)  # exactly the pool
    h.run()
    h.check_outputs()


def test_config_validation():
    for kwargs in (dict(policy="fifo"), dict(max_batch_size=0), dict(num_batches_in_flight=0),
                   dict(policy="orca", max_num_batched_tokens=8),
                   dict(policy="paged", max_num_batched_tokens=0)):
        with pytest.raises(ValueError):
            SchedulerConfig(**kwargs)


# Random arrival and abort streams: every invariant, every step; everything freed at the end.
events = st.lists(st.tuples(st.integers(0, 2),  # arrivals this step
                            st.integers(1, 24),  # prompt length
                            st.integers(1, 20),  # max tokens
                            st.integers(0, 9)),  # 0: abort a random live request
                  min_size=1, max_size=40)


def abort_one_then_step(h: Harness, abort: bool, data) -> None:
    """Abort a live request drawn from ``data`` (when ``abort``), then run one step."""
    live = sorted(h.scheduler.requests)
    if abort and live:
        h.scheduler.abort(data.draw(st.sampled_from(live)))
    h.step()


@pytest.mark.parametrize("policy", ["orca", "paged", "request"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=events, block_size=st.sampled_from([1, 4, 16]), extra=st.integers(0, 48),
       max_batch_size=st.integers(1, 6), in_flight=st.sampled_from([1, 1, 2]),
       budget=st.sampled_from([None, 4, 16]), data=st.data())
def test_random_streams(allocator_cls, policy, stream, block_size, extra, max_batch_size,
                        in_flight, budget, data):
    num_blocks = -(-44 // block_size) + extra // block_size  # every request fits alone
    h = Harness(allocator_cls, policy, num_blocks=num_blocks, block_size=block_size,
                max_batch_size=max_batch_size, num_batches_in_flight=in_flight,
                max_num_batched_tokens=budget if policy == "paged" else None)
    for arrivals, prompt_len, max_tokens, abort in stream:
        for _ in range(arrivals):
            h.add(prompt_len, max_tokens)
        abort_one_then_step(h, abort == 0, data)
    h.run()
    h.check_outputs()
    assert h.allocator.num_free_blocks == num_blocks


# Prefix caching (the real allocator only: the fake has no cache).
SYSTEM = [(7 * i + 3) % VOCAB for i in range(48)]  # a shared "system prompt"


def test_prefix_hit_runs_only_the_rest():
    h = Harness(_real_allocator(), "orca", block_size=4, prefix_caching=True)
    first = h.add(0, 3, SYSTEM[:10])
    h.run()
    second = h.add(0, 3, SYSTEM[:10] + [1, 2])
    out = h.scheduler.schedule()
    (new,), (row,) = out.new_requests, out.requests
    # Its first two blocks are cached; its third (holding its last token) differs anyway.
    assert row.num_computed == 8 and row.token_ids == second.prompt_token_ids[8:]
    assert new.computed_token_ids == SYSTEM[:8]
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0
    assert h.allocator.blocks(second.request_id)[:2] == row.new_block_ids[:2]
    h.pending.append(out)
    h.run()
    h.check_outputs()
    assert h.scheduler.stats().prefix_cache_hits == 8


def test_prefix_of_a_cached_prompt_computes_its_last_token():
    """A prompt that is exactly a cached block sequence still computes its last token."""
    h = Harness(_real_allocator(), "paged", block_size=4, prefix_caching=True)
    h.add(0, 2, SYSTEM[:12])
    h.run()
    again = h.add(0, 2, SYSTEM[:12])
    one_block = h.add(0, 2, SYSTEM[:4])
    out = h.scheduler.schedule()
    rows = {r.request_id: r for r in out.requests}
    assert rows[again.request_id].num_computed == 8
    assert rows[again.request_id].token_ids == SYSTEM[8:12]
    assert rows[one_block.request_id].num_computed == 0  # its only block holds its last token
    h.pending.append(out)
    h.run()
    h.check_outputs()


def test_orca_reserves_only_the_blocks_it_newly_takes():
    """Two requests sharing 8 of their 12 prompt blocks fit a pool that holds one alone
    (12 + 4 = 16 blocks) plus the other's 4 new prompt blocks and 4 output blocks."""
    h = Harness(_real_allocator(), "orca", num_blocks=24, block_size=4, prefix_caching=True)
    h.add(0, 16, SYSTEM[:32] + [1] * 16)
    h.step()  # the first computes and caches its prompt
    h.add(0, 16, SYSTEM[:32] + [2] * 16)
    h.step()
    assert len(h.scheduler.running) == 2  # without sharing it would need 16 + 16 > 24 blocks
    h.scheduler.abort(0)  # the shared blocks' other holder ends: the second keeps them
    h.run()
    h.check_outputs()


def test_paged_recompute_hits_its_own_cached_blocks():
    h = Harness(_real_allocator(), "paged", num_blocks=12, block_size=4, max_batch_size=4,
                prefix_caching=True)
    h.add(10, 30)
    second = h.add(10, 30)
    h.run()
    h.check_outputs()
    assert h.scheduler.num_preemptions > 0
    rows = [r for b in h.runner.batches for r in b.requests if r.request_id == second.request_id]
    restarts = [i for i, r in enumerate(rows) if i and r.num_computed < rows[i - 1].num_computed
                + len(rows[i - 1].token_ids)]
    assert restarts and any(rows[i].num_computed > 0 for i in restarts)


@pytest.mark.parametrize("policy", ["orca", "paged"])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_arrivals_sharing_a_prompt_wait_for_its_blocks(policy, in_flight):
    """Requests sharing a prompt that arrive together: the first computes it, the others wait
    for its batch and then reuse it, instead of all computing the same blocks at once."""
    h = Harness(_real_allocator(), policy, block_size=4, num_batches_in_flight=in_flight,
                prefix_caching=True)
    first = h.add(0, 3, SYSTEM[:20] + [1])
    others = [h.add(0, 3, SYSTEM[:20] + [2 + i]) for i in range(3)]
    h.step()
    (batch,) = h.runner.batches
    assert [r.request_id for r in batch.requests] == [first.request_id]
    h.run()
    h.check_outputs()
    assert [r.num_cached_tokens for r in others] == [20, 20, 20]
    assert h.scheduler.stats().prefix_cache_hits == 60
    assert not h.scheduler._pending_hashes  # nothing is left counted once every batch returned


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_wait_for_a_prefix_only_for_blocks_being_computed(policy):
    """A request whose prompt shares no block with the batch being computed is admitted with
    it; one that shares blocks already cached is admitted too (nothing to wait for)."""
    h = Harness(_real_allocator(), policy, block_size=4, prefix_caching=True)
    h.add(0, 2, SYSTEM[:8] + [1])
    h.run()
    cached = h.add(0, 2, SYSTEM[:8] + [2])  # its shared blocks are already in the cache
    unrelated = h.add(9, 2)
    out = h.scheduler.schedule()
    assert [r.request_id for r in out.requests] == [cached.request_id, unrelated.request_id]
    h.pending.append(out)
    h.run()
    h.check_outputs()


def test_paged_waits_for_a_shared_prompt_computed_in_chunks():
    h = Harness(_real_allocator(), "paged", block_size=4, max_num_batched_tokens=8,
                prefix_caching=True)
    first = h.add(0, 2, SYSTEM[:24] + [1])
    second = h.add(0, 2, SYSTEM[:24] + [2])
    h.run()
    h.check_outputs()
    assert second.num_cached_tokens == 24 and first.num_cached_tokens == 0


def test_prefix_caching_needs_orca_or_paged():
    with pytest.raises(ValueError, match="policy='request'"):
        SchedulerConfig("request", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prefix_cache_salt"):
        SchedulerConfig(prefix_cache_salt=2**63)


# Arrivals sharing prefixes of one system prompt, and later turns resending an earlier request's
# prompt and answer; aborts; every invariant each step, the whole pool reclaimable at the end.
shared_events = st.lists(st.tuples(st.integers(0, 2),  # arrivals this step
                                   st.integers(0, 40),  # tokens of the system prompt
                                   st.integers(0, 10),  # own tokens
                                   st.integers(1, 12),  # max tokens
                                   st.integers(0, 4),  # 0: a next turn of an earlier request
                                   st.integers(0, 9)),  # 0: abort a random live request
                         min_size=1, max_size=30)


@pytest.mark.parametrize("policy", ["orca", "paged"])
@settings(max_examples=40, deadline=None)
@given(stream=shared_events, block_size=st.sampled_from([1, 4, 16]), extra=st.integers(0, 64),
       max_batch_size=st.integers(1, 6), in_flight=st.sampled_from([1, 1, 2]),
       budget=st.sampled_from([None, 4, 16]), data=st.data())
def test_random_streams_prefix_caching(policy, stream, block_size, extra, max_batch_size,
                                       in_flight, budget, data):
    num_blocks = -(-80 // block_size) + extra // block_size  # every request fits alone
    h = Harness(_real_allocator(), policy, num_blocks=num_blocks, block_size=block_size,
                max_batch_size=max_batch_size, num_batches_in_flight=in_flight,
                max_num_batched_tokens=budget if policy == "paged" else None,
                prefix_caching=True)
    for arrivals, shared, own, max_tokens, turn, abort in stream:
        for _ in range(arrivals):
            rid = len(h.requests)
            prompt = SYSTEM[:shared] + [(rid * 13 + i) % VOCAB for i in range(own)]
            done = [r for r in h.requests if r.finish_reason == "length"]
            if turn == 0 and done:
                earlier = data.draw(st.sampled_from(done))
                prompt = (earlier.all_token_ids + prompt)[:64]
            h.add(0, max_tokens, prompt or [1])
        abort_one_then_step(h, abort == 0, data)
    h.run()
    h.check_outputs()
