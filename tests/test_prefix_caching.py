"""Prefix caching in the scheduler, engine, LLM and server (docs/internals.md, "Prefix caching
in the scheduler"): a hypothesis state machine over the scheduler with the real allocator and a
KV-storing fake runner, adversarial cases, the configuration, and greedy outputs identical with
caching on and off on the tiny models."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from engine_fakes import KVFakeRunner, _real_allocator, fake_info, reference

from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.outputs import RequestOutput
from orca_ext.request import Request
from orca_ext.sampling_params import SamplingParams
from orca_ext.scheduler import SchedulerConfig, make_scheduler

VOCAB = 95
SYSTEM = [(11 * i + 5) % VOCAB for i in range(40)]  # a shared system prompt


class SchedulerMachine(RuleBasedStateMachine):
    """add / step / abort / finish / preempt on a small pool, every invariant after each rule;
    at the end every request runs out and the whole pool is reclaimable."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    @initialize(policy=st.sampled_from(["orca", "paged"]), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(6, 14), max_batch_size=st.integers(1, 4))
    def setup(self, policy: str, block_size: int, num_blocks: int, max_batch_size: int) -> None:
        self.policy = policy
        self.allocator = _real_allocator()(-(-24 // block_size) + num_blocks, block_size)
        self.scheduler = make_scheduler(
            SchedulerConfig(policy, max_batch_size, enable_prefix_caching=True,
                            prefix_cache_salt=7, check_kv_writes=True),
            self.allocator)
        self.runner = KVFakeRunner(self.allocator, VOCAB)
        self.capacity = self.allocator.num_blocks * block_size

    @rule(shared=st.integers(0, 16), own=st.integers(0, 5), max_tokens=st.integers(1, 8),
          turn=st.integers(0, 3), data=st.data())
    def add(self, shared: int, own: int, max_tokens: int, turn: int, data) -> None:
        rid = len(self.requests)
        prompt = SYSTEM[:shared] + [(rid * 17 + i) % VOCAB for i in range(own)]
        if turn == 0 and self.requests:  # a next turn: an earlier conversation resent
            earlier = data.draw(st.sampled_from(self.requests))
            prompt = earlier.all_token_ids + prompt
        prompt = (prompt or [rid % VOCAB])[:self.capacity - max_tokens]
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
        self.scheduler.add_request(request)
        self.requests.append(request)

    @rule()
    def step(self) -> None:
        out = self.scheduler.schedule()
        if out.requests:
            self.scheduler.update(self.runner.execute(out))

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self.scheduler.abort(data.draw(st.sampled_from(sorted(self.scheduler.requests))))

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        """A stop string found by the engine ends a running request early."""
        request = data.draw(st.sampled_from(self.scheduler.running))
        self.scheduler.finish(request, "stop", "</s>")

    @precondition(lambda self: self.policy == "paged" and self.scheduler.running)
    @rule()
    def preempt(self) -> None:
        self.scheduler._preempt(self.scheduler.running[-1])

    @invariant()
    def bookkeeping(self) -> None:
        if not hasattr(self, "allocator"):
            return
        alloc, sched = self.allocator, self.scheduler
        alloc.check_invariants()
        blocks = [b for r in sched.running for b in alloc.blocks(r.request_id)]
        read_only = {b for r in sched.running
                     for b in alloc.blocks(r.request_id)[:alloc.shared_prefix_blocks(r.request_id)]}
        assert {b for b in blocks if blocks.count(b) > 1} <= read_only
        assert len(set(blocks)) == alloc.num_used_blocks
        assert all(r.request_id not in alloc for r in sched.waiting)
        # FCFS: every running request arrived before every waiting one.
        if sched.running and sched.waiting:
            assert max(r.request_id for r in sched.running) < sched.waiting[0].request_id
        for r in sched.running:
            assert alloc.capacity(r.request_id) >= r.num_computed
            if self.policy == "orca":  # never starved: it holds every block it will need
                assert alloc.capacity(r.request_id) >= r.max_total_tokens
        if self.policy == "orca":
            assert sched.num_preemptions == 0

    def teardown(self) -> None:
        if not hasattr(self, "allocator"):
            return
        steps = 0
        while self.scheduler.requests:
            self.step()
            self.bookkeeping()
            steps += 1
            assert steps < 2000, "no progress"
        for r in self.requests:
            expected = reference(r.prompt_token_ids, r.max_new_tokens, VOCAB)
            if r.finish_reason == "length":
                assert r.output_token_ids == expected
            else:
                assert r.output_token_ids == expected[:len(r.output_token_ids)]
        alloc = self.allocator
        assert alloc.num_requests == 0 and alloc.num_used_blocks == 0
        assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))
        assert alloc.num_free_blocks == alloc.num_blocks
        alloc.reset_prefix_cache()
        assert alloc.num_cached_blocks == 0
        alloc.allocate(-1, self.capacity)  # the whole pool, in one request
        alloc.free(-1)


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase


# ---------------------------------------------------------------------------------------------
# Adversarial cases through the engine (a fake runner, the real allocator).

def _engine(policy: str = "orca", num_blocks: int = 32, block_size: int = 4,
            caching: bool = True, max_batch_size: int = 8) -> Engine:
    allocator = _real_allocator()(num_blocks, block_size)
    scheduler = make_scheduler(SchedulerConfig(policy, max_batch_size,
                                               enable_prefix_caching=caching,
                                               check_kv_writes=True), allocator)
    return Engine(KVFakeRunner(allocator, VOCAB), scheduler, fake_info(512, VOCAB))


def _run(engine: Engine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_check_kv_writes_catches_a_write_into_a_cached_block(policy):
    """A scheduler bug (here: an allocator that reports no cached prefix, so a request that
    shares cached blocks recomputes them) is a ValueError before the batch runs."""
    class ForgetsTheHit(_real_allocator()):
        def allocate(self, *args):
            super().allocate(*args)
            return 0

    allocator = ForgetsTheHit(32, 4)
    config = SchedulerConfig(policy, 8, enable_prefix_caching=True, check_kv_writes=True)
    engine = Engine(KVFakeRunner(allocator, VOCAB), make_scheduler(config, allocator),
                    fake_info(512, VOCAB))
    engine.add_request("a", SYSTEM[:16], GREEDY)
    _run(engine)  # its prompt's 4 full blocks are cached now
    engine.add_request("b", SYSTEM[:16] + [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match=r"would write position 0 into block \d+, which holds "
                                         r"cached \(read-only\) KV"):
        engine.step()


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_abort_a_request_sharing_blocks(policy):
    engine = _engine(policy)
    alloc = engine.scheduler.allocator
    engine.add_request("a", SYSTEM[:20], GREEDY)
    engine.step()  # a's prompt computed and cached
    engine.add_request("b", SYSTEM[:20] + [1, 2], GREEDY)
    engine.add_request("c", SYSTEM[:20] + [3], GREEDY)
    engine.step()
    shared = alloc.blocks(1)[:4]
    assert shared == alloc.blocks(0)[:4] == alloc.blocks(2)[:4]
    assert all(alloc.ref_count(b) == 3 for b in shared)
    engine.abort("b")
    assert all(alloc.ref_count(b) == 2 for b in shared)
    done = _run(engine)
    for rid, prompt in (("a", SYSTEM[:20]), ("c", SYSTEM[:20] + [3])):
        assert done[rid].outputs[0].token_ids == reference(prompt, 6, VOCAB)
    assert done["c"].num_cached_tokens == 20 and done["a"].num_cached_tokens == 0
    assert alloc.num_used_blocks == 0 and all(alloc.ref_count(b) == 0 for b in shared)
    alloc.check_invariants()


def test_abort_mid_prefill_leaves_nothing_cached():
    """A client gone while its chunked prompt runs: the chunks computed so far stay cached
    (correct KV), the rest is freed, and a later identical prompt computes the same answer."""
    engine = _engine("paged", num_blocks=16)
    engine.scheduler.config.max_num_batched_tokens = 8
    prompt = SYSTEM[:30]
    engine.add_request("gone", prompt, GREEDY)
    engine.step()
    engine.step()  # 16 of 30 prompt tokens computed
    engine.abort("gone")
    alloc = engine.scheduler.allocator
    assert alloc.num_used_blocks == 0 and alloc.num_cached_blocks == 4
    engine.add_request("again", prompt, GREEDY)
    done = _run(engine)
    assert done["again"].outputs[0].token_ids == reference(prompt, 6, VOCAB)
    assert done["again"].num_cached_tokens == 16


@pytest.mark.parametrize("policy", ["orca", "paged"])
def test_pool_too_small_for_any_caching(policy):
    """Each request needs the whole pool: nothing cached survives the next admission, and every
    answer is right."""
    engine = _engine(policy, num_blocks=6, max_batch_size=4)
    prompts = [SYSTEM[:16] + [i] for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=7,
                                                          ignore_eos=True))
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == reference(prompt, 7, VOCAB)
    alloc = engine.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks
    alloc.check_invariants()


def test_stats_count_queries_hits_and_cached_share():
    engine = _engine("orca")
    engine.add_request("a", SYSTEM[:17], GREEDY)
    _run(engine)
    engine.add_request("b", SYSTEM[:17], GREEDY)
    _run(engine)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (34, 16)
    assert stats.num_cached_blocks == engine.scheduler.allocator.num_cached_blocks > 0
    assert stats.prefix_cache_usage == stats.num_cached_blocks / stats.num_blocks
    off = _engine("orca", caching=False)
    off.add_request("a", SYSTEM[:17], GREEDY)
    _run(off)
    assert off.stats().num_cached_blocks == off.stats().prefix_cache_queries == 0


def test_runner_history_holds_the_reused_prefix():
    """The runner's token history (what penalties read) is the whole prompt even though only
    the part past the cached prefix runs."""
    engine = _engine("orca")
    engine.add_request("a", SYSTEM[:13], GREEDY)
    _run(engine)
    engine.add_request("b", SYSTEM[:13], GREEDY)
    engine.step()
    out = engine.executor.batches[-1]
    (new,), (row,) = out.new_requests, out.requests
    assert (row.num_computed, new.computed_token_ids, row.token_ids) == (12, SYSTEM[:12],
                                                                          SYSTEM[12:13])
    state = engine.executor.inputs.requests[row.request_id]
    assert state.prompt_token_ids == SYSTEM[:13] and len(state.output_token_ids) == 0


# ---------------------------------------------------------------------------------------------
# Configuration.

def test_engine_config_default_and_request_policy():
    assert EngineConfig("orca-tiny", device="cpu").enable_prefix_caching is True
    assert EngineConfig("orca-tiny", device="cpu", policy="paged").enable_prefix_caching is True
    assert EngineConfig("orca-tiny", device="cpu", policy="request").enable_prefix_caching \
        is False
    assert not EngineConfig("orca-tiny", device="cpu",
                            enable_prefix_caching=False).scheduler_config().enable_prefix_caching
    with pytest.raises(ValueError, match="policy='request'"):
        EngineConfig("orca-tiny", device="cpu", policy="request", enable_prefix_caching=True)
    salts = {EngineConfig("orca-tiny", device="cpu", dtype=d).prefix_cache_salt()
             for d in ("float32", "bfloat16")}
    assert len(salts) == 2


def test_serve_flag():
    from orca_ext.server.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args([]).enable_prefix_caching is None
    assert parser.parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False


# ---------------------------------------------------------------------------------------------
# Greedy outputs identical with caching on and off, on the tiny models.

def _workloads(tokenize) -> dict[str, list[list[int]]]:
    system = tokenize("You are a helpful assistant. Answer briefly and politely. ")
    return {
        "shared_system_prompt": [system + tokenize(q) for q in
                                 ("What is two plus two?", "Name a colour.", "Hi", "Why?")],
        "prefixes_of_each_other": [system[:n] for n in (9, 16, 17, 31, 32, 33, len(system))],
        "one_block": [system[:16], system[:16], system[16:32]],
        "diverge_mid_block": [system[:20] + tokenize(s) for s in ("abcdef", "abcxyz", "abq")],
    }


def _generate(llm, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):  # staggered: one arrival per step, so later ones hit
        engine.add_request(str(i), prompt, params)
        engine.step()
    done = _run(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _conversation(llm, turns: list[list[int]]) -> list[list[int]]:
    """Multi-turn: each turn resends the conversation so far (questions and answers)."""
    history, answers = [], []
    for turn in turns:
        history = history + turn
        (answer,) = _generate(llm, [history])
        answers.append(answer)
        history = history + answer
    return answers


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """orca-tiny and each family of tests/tiny_models.py, loaded in float32."""
    model_lib = pytest.importorskip("orca_ext.model")
    from tiny_models import SPECS, make_hf_model, save_hf_model

    models = {"orca-tiny": model_lib.load_model("orca-tiny", "float32", "cpu")}
    for name in SPECS:
        folder = save_hf_model(make_hf_model(name), tmp_path_factory.mktemp(name))
        models[name] = model_lib.load_model(str(folder), "float32", "cpu")
    return models


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy", ["orca", "paged"])
@pytest.mark.parametrize("name", ["orca-tiny", "gpt2", "llama_gqa", "llama_tied", "qwen2",
                                  "mistral"])
def test_greedy_outputs_identical_with_caching_on_and_off(tiny_models, name, policy):
    from orca_ext import LLM

    loaded = tiny_models[name]

    def tokenize(text: str) -> list[int]:
        return list(loaded.tokenizer.encode(text))

    workloads = _workloads(tokenize)
    turns = [tokenize(t) for t in ("Hello there. ", "Tell me more, please. ", "And then? ")]
    results = {}
    for caching in (False, True):
        kv_tokens = 160 if policy == "paged" else 1024  # paged: small enough to preempt
        llm = LLM(loaded, policy=policy, block_size=16, max_batch_size=4,
                  kv_cache_tokens=kv_tokens, enable_prefix_caching=caching)
        results[caching] = ({k: _generate(llm, v) for k, v in workloads.items()},
                            _conversation(llm, turns))
        stats = llm.engine.stats()
        assert stats.num_used_blocks == 0
        if caching:
            assert stats.prefix_cache_hits > 0
            llm.engine.scheduler.allocator.check_invariants()
    assert results[True] == results[False]


# ---------------------------------------------------------------------------------------------
# The server: usage.prompt_tokens_details.cached_tokens, /metrics, the OpenAPI document.

def test_server_reports_cached_tokens_and_metrics():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import asyncio

    from orca_ext import build_engine
    from orca_ext.async_engine import AsyncEngine
    from orca_ext.server import create_app
    from server_helpers import PLAIN_CHAT_TEMPLATE

    engine = AsyncEngine(build_engine(EngineConfig("orca-tiny", device="cpu", max_batch_size=4,
                                                   kv_cache_tokens=1024)))
    app = create_app(engine, model_name="tiny", chat_template=PLAIN_CHAT_TEMPLATE)
    prompt = "You are a helpful assistant. Answer briefly and politely. " * 2
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            first = await client.post("/v1/completions", json=body)
            second = await client.post("/v1/completions", json=body)
            chunks = []
            async with client.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(line)
            again = await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 2})
            metrics = await client.get("/metrics")
            return first.json(), second.json(), chunks, again.json(), metrics.text

    try:
        first, second, chunks, again, metrics = asyncio.run(main())
    finally:
        engine.shutdown()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16 > 0
    assert '"prompt_tokens_details"' in chunks[-1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("orca_prefix_cache")}
    assert values["orca_prefix_cache_hits_total"] >= cached + 16
    assert values["orca_prefix_cache_queries_total"] >= values["orca_prefix_cache_hits_total"]
    assert 0 < values["orca_prefix_cache_usage_ratio"] <= 1
    assert values["orca_prefix_cache_blocks"] > 0
    schemas = app.openapi()["components"]["schemas"]
    assert schemas["Usage"]["properties"]["prompt_tokens_details"]
    assert "cached_tokens" in schemas["PromptTokensDetails"]["properties"]


# ---------------------------------------------------------------------------------------------
# The real default model: a shared system prompt, caching on and off.

@pytest.mark.usefixtures("one_thread")
def test_real_model_shared_system_prompt():
    from orca_ext import LLM
    from orca_ext.model import load_model
    from orca_ext.model.builtin import DEFAULT_MODEL

    loaded = load_model(DEFAULT_MODEL, "float32")
    system = ("You are a concise assistant for a travel company. Answer in one short sentence, "
              "be friendly, and never invent prices or dates you were not given.")
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is the capital of France?", "Name a good beach in Spain.",
                       "How far is Rome from Milan?")]
    params = SamplingParams(temperature=0, max_tokens=12)
    answers = {}
    for caching in (False, True):
        llm = LLM(loaded, max_batch_size=1, kv_cache_tokens=2048, enable_prefix_caching=caching)
        outputs = llm.chat(chats, params, use_tqdm=False)
        answers[caching] = [list(o.outputs[0].token_ids) for o in outputs]
        if caching:
            assert [o.num_cached_tokens > 0 for o in outputs] == [False, True, True]
    assert answers[True] == answers[False]
