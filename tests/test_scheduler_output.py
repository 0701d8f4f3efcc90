"""The scheduler's output is self-contained plain data: a request's data once, then deltas."""
from __future__ import annotations

import pickle

import pytest

from orca_ext.batch import RunnerOutput
from orca_ext.kv import SlotAllocator
from orca_ext.request import Request
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler


def run(policy: str, prompt_len: int, num_requests: int = 32, steps: int = 3,
        num_blocks: int = 4096):
    """The pickled size of each batch's SchedulerOutput, and the outputs, over ``steps``."""
    allocator = SlotAllocator(num_blocks, 16)
    scheduler = make_scheduler(SchedulerConfig(policy, max_batch_size=num_requests), allocator)
    for rid in range(num_requests):
        scheduler.add_request(Request(rid, list(range(prompt_len)),
                                      SamplingParams(max_tokens=64), 64))
    outputs, sizes = [], []
    for _ in range(steps):
        out = scheduler.schedule()
        outputs.append(out)
        sizes.append(len(pickle.dumps(out)))
        scheduler.update(RunnerOutput(out.batch_id, [r.request_id for r in out.requests],
                                      [1] * len(out.requests), [None] * len(out.requests)))
    return sizes, outputs


@pytest.mark.parametrize("policy", ["orca", "paged", "request"])
def test_new_request_data_once_then_deltas(policy):
    _, (first, second, third) = run(policy, prompt_len=40, num_requests=4)
    assert [n.request_id for n in first.new_requests] == [0, 1, 2, 3]
    assert all(n.num_prompt_tokens == 40 for n in first.new_requests)
    assert all(len(r.token_ids) == 40 and r.num_computed == 0 for r in first.requests)
    blocks = 3 if policy == "paged" else 7  # paged: the prompt; orca/request: + max_tokens
    assert all(len(r.new_block_ids) == blocks for r in first.requests)
    for later in (second, third):
        assert later.new_requests == []
        assert all(r.token_ids == [1] for r in later.requests)
        # paged grows a request at its 49th token, not before
        assert all(r.new_block_ids == [] for r in later.requests)


def test_a_decode_steps_message_does_not_grow_with_the_prompt():
    """The distributed control message: after the first batch, a decode step carries one token
    per request, whatever the prompts' lengths."""
    short, _ = run("orca", prompt_len=16, num_blocks=8192)
    long, _ = run("orca", prompt_len=1024, num_blocks=8192)
    assert long[0] > 10 * short[0]  # the prompts go once
    assert max(long[1:]) < 1.1 * min(short[1:])  # only num_computed's encoding grows


def test_a_preempted_request_comes_back_as_new():
    allocator = SlotAllocator(6, 4)  # 24 slots: two 10-token prompts, then one must go
    scheduler = make_scheduler(SchedulerConfig("paged", max_batch_size=4), allocator)
    for rid in range(2):
        scheduler.add_request(Request(rid, list(range(10)), SamplingParams(max_tokens=8), 8))
    seen_new, ended = [], []
    for _ in range(12):
        out = scheduler.schedule()
        seen_new += [n.request_id for n in out.new_requests]
        ended += out.finished_request_ids
        if not out.requests:
            continue
        for r in out.requests:  # a new request's blocks arrive with it, then only additions
            if r.request_id in [n.request_id for n in out.new_requests]:
                assert r.num_computed == 0 and r.new_block_ids
        scheduler.update(RunnerOutput(out.batch_id, [r.request_id for r in out.requests],
                                      [1] * len(out.requests), [None] * len(out.requests)))
    assert scheduler.num_preemptions >= 1
    assert seen_new.count(1) == 2 and 1 in ended  # dropped, then sent again
