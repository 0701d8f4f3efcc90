"""End to end with the built-in model: the offline API, and the same greedy outputs whatever
the policy, batch size or arrival pattern."""
from __future__ import annotations

import asyncio

import pytest

model_lib = pytest.importorskip("orca_ext.model", reason="model side not importable")

from orca_ext.async_engine import AsyncEngine  # noqa: E402
from orca_ext import LLM, EngineConfig, build_engine  # noqa: E402
from orca_ext.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "a" * 40, "Orca", "x",
           "Once upon a time there"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded():
    return model_lib.load_model("orca-tiny", "float32", "cpu")


@pytest.fixture(scope="module")
def expected(loaded):
    """Each prompt alone, one request per batch."""
    llm = LLM(loaded, max_batch_size=1, kv_cache_tokens=512)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [
    dict(policy="orca", max_batch_size=16, kv_cache_tokens=2048),
    dict(policy="orca", max_batch_size=3, kv_cache_tokens=2048, block_size=1),
    dict(policy="request", max_batch_size=4, kv_cache_tokens=2048),
    dict(policy="paged", max_batch_size=8, kv_cache_tokens=64, block_size=8),  # preempts
    dict(policy="paged", max_batch_size=8, kv_cache_tokens=1024, max_num_batched_tokens=16),
], ids=["orca", "orca-bs3-block1", "request", "paged-preempt", "paged-chunked"])
def test_same_greedy_outputs_whatever_the_schedule(loaded, expected, kwargs):
    engine = build_engine(EngineConfig(loaded, **kwargs))
    for i, prompt in enumerate(PROMPTS):  # staggered arrivals: one new request per step
        engine.add_request(str(i), prompt, GREEDY)
        engine.step()
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finished[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    if kwargs.get("kv_cache_tokens") == 64:
        assert engine.stats().num_preemptions > 0
    assert engine.stats().num_used_blocks == 0


def test_generate_api(loaded, expected):
    llm = LLM(loaded, max_batch_size=4, kv_cache_tokens=1024)
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, out, tokens in zip(PROMPTS, outputs, expected):
        c = out.outputs[0]
        assert out.finished and out.prompt_token_ids == tokenizer.encode(prompt)
        assert c.token_ids == tokens and c.finish_reason == "length"
        assert c.text == tokenizer.decode(tokens)
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time
    ids = outputs[2].prompt_token_ids
    again = llm.generate(ids, GREEDY, use_tqdm=False)  # one prompt of token ids
    assert again[0].prompt is None and again[0].outputs[0].token_ids == expected[2]
    # vLLM's TextPrompt and TokensPrompt dicts, one or a list.
    typed = llm.generate([{"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}], GREEDY,
                         use_tqdm=False)
    assert typed[0].prompt == PROMPTS[1] and typed[0].outputs[0].token_ids == expected[1]
    assert typed[1].prompt is None and typed[1].outputs[0].token_ids == expected[2]
    one = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == expected[2]
    sampled = SamplingParams(n=2, max_tokens=3, seed=1, ignore_eos=True, logprobs=2)
    mixed = llm.generate(["x", "y"], [GREEDY, sampled], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == expected[4]
    assert len(mixed[1].outputs) == 2 and all(len(c.logprobs) == 3 for c in mixed[1].outputs)


def test_bad_input_keeps_llm_usable(loaded, expected):
    llm = LLM(loaded, max_batch_size=4, kv_cache_tokens=256)
    for prompts, params, field in (([""], GREEDY, "prompt"),
                                   (["ok", "a" * 2000], GREEDY, "prompt"),
                                   (["ok"], SamplingParams(max_tokens=300), "max_tokens"),
                                   (["ok", "ok"], [GREEDY], "sampling_params"),
                                   ([{"prompt": "ok", "multi_modal_data": {}}], GREEDY,
                                    r"one key, 'prompt' \(text\) or 'prompt_token_ids'"),
                                   ([{"prompt_token_ids": ["a"]}], GREEDY,
                                    "token ids must be integers")):
        with pytest.raises(ValueError, match=field):
            llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[0]


def test_async_engine_streams(loaded, expected):
    engine = AsyncEngine(build_engine(EngineConfig(loaded, max_batch_size=4,
                                                   kv_cache_tokens=1024)))

    async def main():
        async def one(i):
            return [o async for o in engine.generate(PROMPTS[i], GREEDY, f"r{i}")]
        return await asyncio.gather(*(one(i) for i in range(3)))

    try:
        for i, outputs in enumerate(asyncio.run(main())):
            assert len(outputs) == 8 and outputs[-1].outputs[0].token_ids == expected[i]
        assert engine.is_healthy()
    finally:
        engine.shutdown()
