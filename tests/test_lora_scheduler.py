"""The scheduler's LoRA slots: a request runs only while its adapter holds one of max_loras
slots; one that cannot get a slot stops the queue (FCFS); slots free as requests end or are
preempted, least recently used first; the runner is told each new request's slot."""
from __future__ import annotations

import pytest

from orca_ext.kv import SlotAllocator
from orca_ext.batch import RunnerOutput
from orca_ext.lora.slots import LoRASlots
from orca_ext.request import Request
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler


def make(policy: str = "orca", max_loras: int = 1, num_blocks: int = 64):
    config = SchedulerConfig(policy, max_batch_size=8, max_loras=max_loras)
    return make_scheduler(config, SlotAllocator(num_blocks, 4))


def add(scheduler, rid: int, lora: int, max_new: int = 2) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_new), max_new,
                      lora_int_id=lora)
    scheduler.add_request(request)
    return request


def step(scheduler) -> list[int]:
    out = scheduler.schedule()
    ids = [r.request_id for r in out.requests]
    scheduler.update(RunnerOutput(out.batch_id, ids, [7] * len(ids), [None] * len(ids)))
    return ids, out


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_one_slot_serves_adapters_in_arrival_order(policy):
    s = make(policy, max_loras=1)
    add(s, 0, lora=1)
    add(s, 1, lora=0)  # the base needs no slot, but waits behind its elders (FCFS)
    add(s, 2, lora=2)
    add(s, 3, lora=1)
    ids, out = step(s)
    assert ids == [0, 1]  # 2 has no slot, so 3 (same adapter as 0) does not overtake it
    assert [(n.request_id, n.lora_int_id, n.lora_slot) for n in out.new_requests] == \
        [(0, 1, 0), (1, 0, -1)]
    ids, _ = step(s)
    assert ids == [0, 1]  # both finish now (max_new 2)
    ids, out = step(s)
    assert ids == [2]  # adapter 2 takes the freed slot; 3's adapter 1 no longer holds it
    assert out.new_requests[0].lora_slot == 0
    step(s)
    ids, out = step(s)
    assert ids == [3] and out.new_requests[0].lora_slot == 0
    assert s.lora_slots.num_active == 1


def test_slots_shared_and_reused_least_recently_used():
    slots = LoRASlots(2)
    assert slots.acquire(5) == 0 and slots.acquire(6) == 1 and slots.acquire(5) == 0
    assert not slots.can_acquire(7)
    slots.release(1)
    assert slots.can_acquire(7) and slots.acquire(7) == 1  # 6's idle slot
    slots.release(0)
    slots.release(0)
    slots.release(1)
    slots.acquire(8)  # both idle: the least recently used (5's, slot 0)
    assert slots.users(8) == 1 and slots.users(5) == 0 and slots.users(7) == 0
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(1) or slots.release(1)


def test_abort_releases_the_slot():
    s = make(max_loras=1)
    add(s, 0, lora=1, max_new=50)
    add(s, 1, lora=2)
    assert step(s)[0] == [0]
    s.abort(0)
    assert step(s)[0] == [1]


def test_paged_preemption_releases_the_slot():
    s = make("paged", max_loras=2, num_blocks=3)
    add(s, 0, lora=1, max_new=8)
    add(s, 1, lora=2, max_new=8)
    for _ in range(6):
        step(s)
    assert s.num_preemptions >= 1
    assert s.lora_slots.num_active == len([r for r in s.running if r.lora_int_id])


def test_lora_needs_a_slot_pool_and_a_policy():
    s = make(max_loras=0)
    with pytest.raises(ValueError, match="needs enable_lora"):
        add(s, 0, lora=3)
    with pytest.raises(ValueError, match="policy 'orca' or 'paged'"):
        SchedulerConfig("request", enable_prefix_caching=False, max_loras=2)


def test_prefix_cache_misses_an_adapter_unloaded_and_replaced_under_its_id():
    """Blocks cached under adapter 1 are hit by its later requests, but not once adapter 1 is
    unloaded (``forget``, as ``Engine.remove_lora`` does) and its id given to another adapter,
    whose KV of the same tokens differs."""
    config = SchedulerConfig("orca", max_batch_size=8, enable_prefix_caching=True, max_loras=1)
    s = make_scheduler(config, SlotAllocator(64, 4))
    prompt = list(range(1, 14))  # 3 full blocks of 4 tokens, and one more token

    def cached_tokens(rid: int) -> int:
        request = Request(rid, prompt, SamplingParams(max_tokens=1), 1, lora_int_id=1)
        s.add_request(request)
        assert step(s)[0] == [rid] and request.finished
        return request.num_cached_tokens

    assert cached_tokens(0) == 0
    assert cached_tokens(1) == 12
    s.lora_slots.forget(1)
    assert cached_tokens(2) == 0
    assert cached_tokens(3) == 12
