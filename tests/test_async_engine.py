"""AsyncEngine: streaming, cancellation, abort, bad input, a dead or stuck loop."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine_fakes import CharTokenizer, FakeSlotAllocator, GatedRunner, fake_info, reference

from orca_ext.async_engine import AsyncEngine, EngineDeadError
from orca_ext.engine import Engine
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler

TOK = CharTokenizer()
VOCAB = TOK.vocab


class FailingRunner(GatedRunner):
    def execute(self, out):
        raise RuntimeError("device lost")


@pytest.fixture
def make():
    engines = []

    def make(runner_cls=GatedRunner, stuck_timeout=300.0, **config):
        allocator = FakeSlotAllocator(64, 4)
        runner = runner_cls(allocator, VOCAB)
        engine = Engine(runner, make_scheduler(SchedulerConfig(**config), allocator),
                        fake_info(512, VOCAB, TOK))
        engines.append(AsyncEngine(engine, stuck_timeout=stuck_timeout))
        return engines[-1], runner

    yield make
    for engine in engines:
        engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_streams_one_output_per_token_concurrently(make):
    engine, _ = make()

    async def main():
        params = SamplingParams(max_tokens=8)
        return await asyncio.gather(*(collect(engine, [i + 1, 2, 3], params, f"r{i}")
                                      for i in range(5)))

    for i, outputs in enumerate(asyncio.run(main())):
        expected = reference([i + 1, 2, 3], 8, VOCAB)
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 9))
        assert [o.finished for o in outputs] == [False] * 7 + [True]
        assert outputs[-1].outputs[0].token_ids == expected
        assert outputs[-1].outputs[0].text == TOK.decode(expected)
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_used_blocks) == (0, 0, 0)
    assert engine.is_healthy()


def test_cancel_aborts_and_frees_kv(make):
    engine, runner = make()
    runner.gate.clear()  # hold the first batch in flight while we cancel

    async def main():
        task = asyncio.create_task(collect(engine, [1, 2, 3], SamplingParams(max_tokens=100),
                                           "c"))
        await wait_for(lambda: engine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        runner.gate.set()
        await wait_for(lambda: engine.stats().num_used_blocks == 0)
        return await collect(engine, [4, 5], SamplingParams(max_tokens=3), "after")

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].token_ids == reference([4, 5], 3, VOCAB)
    assert engine.stats().num_requests == 0


def test_leaving_the_loop_early_aborts(make):
    engine, _ = make()

    async def main():
        async for out in engine.generate([1, 2], SamplingParams(max_tokens=100), "early"):
            if len(out.outputs[0].token_ids) == 2:
                break
        stats = engine.stats
        await wait_for(lambda: stats().num_requests == 0 and stats().num_used_blocks == 0)

    asyncio.run(main())


def test_abort_ends_the_stream(make):
    engine, runner = make()
    runner.gate.clear()

    async def main():
        task = asyncio.create_task(collect(engine, [1, 2], SamplingParams(max_tokens=100), "x"))
        await wait_for(lambda: engine.stats().num_running == 1)
        await engine.abort("x")
        runner.gate.set()
        outputs = await task
        await wait_for(lambda: engine.stats().num_used_blocks == 0)  # after the in-flight batch
        return outputs

    outputs = asyncio.run(main())
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].finish_reason == "abort"


def test_bad_input_raises_and_others_continue(make):
    engine, runner = make()
    runner.gate.clear()  # keep "good" running while the bad ones come in

    async def main():
        good = asyncio.create_task(collect(engine, [1, 2], SamplingParams(max_tokens=20), "good"))
        for prompt, params, field in (("", None, "prompt"), ([1] * 513, None, "prompt"),
                                      ([1], SamplingParams(max_tokens=300), "max_tokens")):
            with pytest.raises(ValueError, match=field):
                await collect(engine, prompt, params, "bad")
        await wait_for(lambda: engine.stats().num_running == 1)
        with pytest.raises(ValueError, match="request_id"):
            await collect(engine, [1], None, "good")
        runner.gate.set()
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].token_ids == reference([1, 2], 20, VOCAB)
    assert engine.is_healthy()


def test_dead_loop_is_reported(make):
    engine, _ = make(FailingRunner)

    async def main():
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(engine, [1, 2], None, "a")
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2], None, "b")

    asyncio.run(main())
    assert not engine.is_healthy()


def test_stuck_loop_is_reported(make):
    engine, runner = make(stuck_timeout=0.05)
    runner.gate.clear()

    async def main():
        task = asyncio.create_task(collect(engine, [1, 2], SamplingParams(max_tokens=2), "s"))
        await asyncio.sleep(0.2)
        assert not engine.is_healthy()
        runner.gate.set()
        outputs = await task
        assert engine.is_healthy()
        return outputs

    assert asyncio.run(main())[-1].finished
