"""The engine's activity record (``orca_ext.activity``, what the dashboard draws) against the
batches the scheduler actually sent to a KV-checking fake runner, under each policy; and the
dashboard's feed (``server.dashboard``), one sampler shared by its clients."""
from __future__ import annotations

import asyncio
import json

from engine_fakes import CharTokenizer, KVFakeRunner, _real_allocator, fake_info

from orca_ext import activity
from orca_ext.async_engine import AsyncEngine
from orca_ext.engine import Engine
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler

VOCAB = 95


def make_engine(policy: str = "orca", num_blocks: int = 64, block_size: int = 4,
                **config: object) -> tuple[Engine, KVFakeRunner]:
    allocator = _real_allocator()(num_blocks, block_size)
    runner = KVFakeRunner(allocator, VOCAB)
    scheduler = make_scheduler(SchedulerConfig(policy, **config), allocator)
    return Engine(runner, scheduler, fake_info(256, VOCAB)), runner


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def check_against_batches(engine: Engine, runner: KVFakeRunner) -> None:
    """Each recorded iteration is a batch the runner ran: the same requests, their token
    counts split into prefill (prompt, chunk, padding) and decode (one sampled token)."""
    sample, stats = engine.activity_sample()
    assert [i.number for i in sample.iterations] == list(range(len(runner.batches)))
    assert stats.num_iterations == len(runner.batches)
    for iteration, batch in zip(sample.iterations, runner.batches):
        assert iteration.start <= iteration.end
        assert [e[0] for e in iteration.entries] == [r.request_id for r in batch.requests]
        for (_, prefill, decode, _), r in zip(iteration.entries, batch.requests):
            assert prefill + decode == len(r.token_ids) + r.num_padding
            assert decode in (0, 1)


def test_orca_records_prefills_packed_with_decodes_and_prefix_hits():
    engine, runner = make_engine("orca", enable_prefix_caching=True)
    system = [(7 * i + 3) % VOCAB for i in range(12)]  # three full blocks
    engine.add_request("a", system + [1, 2], greedy(4))
    engine.step()  # a's prompt alone
    engine.add_request("b", system + [5, 6, 7], greedy(3))
    engine.step()  # a's decode with b's prompt, whose first 12 tokens are cached
    run(engine)
    check_against_batches(engine, runner)
    sample, stats = engine.activity_sample()
    first, second = sample.iterations[:2]
    assert first.entries == ((0, 14, 0, 0),)
    assert second.entries == ((0, 0, 1, 0), (1, 3, 0, 12))
    assert all(e[1:] == (0, 1, 0) for i in sample.iterations[2:] for e in i.entries)
    assert [(e.kind, e.label, e.detail, e.num_output_tokens) for e in sample.events] == [
        ("arrive", "a", 14, 0), ("arrive", "b", 15, 0), ("end", "a", "length", 4),
        ("end", "b", "length", 3)]  # both end in the 4th iteration, in batch order
    assert sample.live == []
    assert stats.iteration_seconds >= 0 and stats.prefix_cache_hits == 12


def test_paged_chunks_and_recomputation_count_as_prefill():
    engine, runner = make_engine("paged", num_blocks=6, block_size=4, max_batch_size=4,
                                 max_num_batched_tokens=6)
    engine.add_request("long", list(range(1, 11)), greedy(10))
    engine.add_request("short", [3, 4, 5], greedy(12))
    run(engine)
    check_against_batches(engine, runner)
    assert engine.scheduler.num_preemptions > 0  # 6 blocks of 4 cannot hold both to the end
    sample, _ = engine.activity_sample()
    long_prefills = [e[1] for i in sample.iterations for e in i.entries if e[0] == 0 and e[1]]
    assert long_prefills[:2] == [6, 4]  # the prompt in chunks of the token budget
    decoded, recomputed = set(), set()
    for iteration in sample.iterations:
        for sequence, prefill, decode, _ in iteration.entries:
            if decode:
                decoded.add(sequence)
            elif sequence in decoded:  # prefill after decoding: recomputed after preemption
                recomputed.add(sequence)
    assert recomputed


def test_request_level_padding_counts_as_prefill():
    engine, runner = make_engine("request", max_batch_size=4)
    engine.add_request("x", [1, 2], greedy(2))
    engine.add_request("y", [1, 2, 3, 4, 5], greedy(2))
    run(engine)
    check_against_batches(engine, runner)
    first = engine.activity_sample()[0].iterations[0]
    assert first.entries == ((0, 5, 0, 0), (1, 5, 0, 0))  # x padded to y's 5 tokens


def test_cursors_live_sequences_abort_and_n_samples():
    engine, _ = make_engine("orca", max_batch_size=1)
    engine.add_request("first", [1, 2, 3], greedy(50))
    engine.add_request("pair", [4, 5], SamplingParams(max_tokens=5, n=2, seed=1))
    engine.step()
    sample, stats = engine.activity_sample()
    assert [(s.label, s.state, s.num_prompt_tokens, s.num_output_tokens) for s in sample.live] \
        == [("pair/0", "waiting", 2, 0), ("pair/1", "waiting", 2, 0),
            ("first", "running", 3, 1)]
    assert (sample.last_iteration, sample.last_event) == (0, 2)
    again, _ = engine.activity_sample(sample.last_iteration, sample.last_event)
    assert again.iterations == [] and again.events == []
    engine.step()
    newer, _ = engine.activity_sample(sample.last_iteration, sample.last_event)
    assert [i.number for i in newer.iterations] == [1] and newer.events == []
    engine.abort("first")
    ended, _ = engine.activity_sample(newer.last_iteration, newer.last_event)
    assert [(e.kind, e.label, e.detail, e.num_output_tokens) for e in ended.events] == [
        ("end", "first", "abort", 2)]
    assert [s.label for s in ended.live] == ["pair/0", "pair/1"]


def test_the_record_is_bounded_and_numbered(monkeypatch):
    monkeypatch.setattr(activity, "ITERATIONS_KEPT", 5)
    monkeypatch.setattr(activity, "EVENTS_KEPT", 3)
    engine, _ = make_engine("orca")
    for i in range(3):
        engine.add_request(f"r{i}", [1 + i, 2], greedy(4))
    run(engine)
    sample, stats = engine.activity_sample()
    assert stats.num_iterations == 4
    assert [i.number for i in sample.iterations] == [0, 1, 2, 3]
    assert [e.number for e in sample.events] == [3, 4, 5]  # 3 arrivals and 3 ends, 3 kept
    for i in range(3, 6):
        engine.add_request(f"r{i}", [1 + i, 2], greedy(4))
    run(engine)
    sample, _ = engine.activity_sample(2, 4)
    assert [i.number for i in sample.iterations] == [3, 4, 5, 6, 7]
    assert [e.number for e in sample.events] == [9, 10, 11]  # 5..8 were dropped: a gap


def test_feed_shares_one_sampler_and_stops_with_the_last_client():
    from orca_ext.server.core import ServingCore
    from orca_ext.server.dashboard import DashboardFeed

    allocator = _real_allocator()(64, 4)
    tokenizer = CharTokenizer()
    engine = AsyncEngine(Engine(KVFakeRunner(allocator, tokenizer.vocab),
                                make_scheduler(SchedulerConfig(), allocator),
                                fake_info(128, tokenizer.vocab, tokenizer)))
    core = ServingCore(engine, "fake")
    feed = DashboardFeed(core, interval=0.02)

    def parse(item: str) -> tuple[str, dict]:
        head, data = item.rstrip("\n").split("\n")
        return head.removeprefix("event: "), json.loads(data.removeprefix("data: "))

    async def scenario() -> None:
        one, two = feed.events(), feed.events()
        name, hello = parse(await one.__anext__())
        assert name == "hello" and hello["config"]["policy"] == "orca"
        assert hello["config"]["block_size"] == 4 and hello["iterations"] == []
        assert parse(await two.__anext__())[0] == "hello"
        sampler = feed._sampler
        async for output in engine.generate("hello", greedy(6), "req"):
            pass
        seen_iterations, ends, rates = set(), [], []
        while not ends:
            first, second = await one.__anext__(), await two.__anext__()
            assert first == second  # both clients get the very same samples
            name, sample = parse(first)
            assert name == "sample"
            seen_iterations |= {i[0] for i in sample["iterations"]}
            ends += [e for e in sample["events"] if e[2] == "end"]
            rates.append(sample["rates"]["tokens_per_s"])
        assert ends[0][4] == "req" and ends[0][5] == "length" and ends[0][6] == 6
        assert seen_iterations == set(range(6))
        assert max(rates) > 0
        await one.aclose()
        assert feed._sampler is sampler and not sampler.done()  # the other still watches
        await two.aclose()
        assert feed._sampler is None
        await asyncio.sleep(0)
        assert sampler.cancelled()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_feed_drops_a_client_that_stops_reading():
    from orca_ext.server.core import ServingCore
    from orca_ext.server import dashboard

    allocator = _real_allocator()(16, 4)
    engine = AsyncEngine(Engine(KVFakeRunner(allocator, VOCAB),
                                make_scheduler(SchedulerConfig(), allocator),
                                fake_info(64, VOCAB)))
    feed = dashboard.DashboardFeed(ServingCore(engine, "fake"), interval=0.001)

    async def scenario() -> None:
        events = feed.events()
        await events.__anext__()  # hello, then nothing read while the sampler runs on
        async with asyncio.timeout(30):
            while feed._clients:
                await asyncio.sleep(0.01)
        received = [item async for item in events]  # what was queued, then the end
        assert 0 < len(received) <= dashboard.QUEUE_LENGTH
        assert feed._sampler is None

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
