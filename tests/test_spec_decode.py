"""Speculative decoding: the same greedy outputs with it on and off (n-gram and a draft model,
every policy, prefix hits, preemption), sampled outputs from the same distribution, the KV
allocators' invariants after every step, and bad configs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

model_lib = pytest.importorskip("orca_ext.model", reason="model side not importable")

from orca_ext import EngineConfig, build_engine  # noqa: E402
from orca_ext.engine import Engine  # noqa: E402
from orca_ext.sampling_params import SamplingParams  # noqa: E402
from orca_ext.spec_decode import SpeculativeConfig  # noqa: E402
from orca_ext.spec_decode.ngram import ngram_proposal  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Repetitive prompts (n-gram proposals find matches), one shared prefix (prefix-cache hits).
SHARED = "def add(a, b):\n    return a + b\n\n"
PROMPTS = [SHARED + "def add(a, b):\n    return", "abcabcabcabcabcabc", SHARED + "x = add(",
           "The cat sat on the mat. The cat sat on", "hello hello hello hello", "zz"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "max_batch_tokens": 256}
DRAFT = {"method": "draft_model", "model": "orca-tiny", "quantization": "q8_0",
         "num_speculative_tokens": 3, "max_batch_tokens": 256}
# The target's own weights drafting (in bfloat16): its greedy proposals are often accepted
# when sampling too.
SELF_DRAFT = {"method": "draft_model", "model": "orca-tiny", "num_speculative_tokens": 2,
              "max_batch_tokens": 512}

SCHEDULES = {
    "orca": dict(policy="orca", max_batch_size=4, kv_cache_tokens=2048, block_size=4),
    "request": dict(policy="request", max_batch_size=3, kv_cache_tokens=2048),
    "paged-preempt": dict(policy="paged", max_batch_size=6, kv_cache_tokens=112, block_size=4),
    "paged-chunked": dict(policy="paged", max_batch_size=6, kv_cache_tokens=1024,
                          max_num_batched_tokens=20),
}


@pytest.fixture(scope="module")
def loaded():
    return model_lib.load_model("orca-tiny", "float32", "cpu")


@pytest.fixture(scope="module")
def expected(loaded):
    """Each prompt alone, without speculation."""
    engine = build_engine(EngineConfig(loaded, max_batch_size=1, kv_cache_tokens=1024))
    return _run(engine, PROMPTS, GREEDY)


def _run(engine: Engine, prompts: list[str], params: SamplingParams | list[SamplingParams],
         check: bool = False) -> list[list[int]]:
    """Outputs of ``prompts`` arriving one per step; ``check``: the allocators' invariants
    after every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    finished = {}
    pending = list(enumerate(zip(prompts, params)))
    while pending or engine.has_unfinished():
        if pending:
            i, (prompt, p) = pending.pop(0)
            engine.add_request(str(i), prompt, p)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        if check:
            _check_invariants(engine)
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _check_invariants(engine: Engine) -> None:
    engine.scheduler.allocator.check_invariants()
    proposer = engine.scheduler.speculator.proposer
    if hasattr(proposer, "allocator"):
        proposer.allocator.check_invariants()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_same_greedy_outputs_with_speculation(loaded, expected, schedule, spec):
    engine = build_engine(EngineConfig(loaded, speculative_config=spec, **SCHEDULES[schedule]))
    assert _run(engine, PROMPTS, GREEDY, check=True) == expected
    # Again: prompts now hit the prefix cache (orca, paged).
    assert _run(engine, PROMPTS, GREEDY, check=True) == expected
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.num_used_blocks == 0
    if schedule == "paged-preempt":
        assert stats.num_preemptions > 0
    if schedule in ("orca", "paged-chunked"):
        assert stats.prefix_cache_hits > 0
    proposer = engine.scheduler.speculator.proposer
    if spec is DRAFT:
        assert proposer.allocator.num_used_blocks == 0  # every request's draft KV freed


def test_max_tokens_and_stops_within_accepted_tokens(loaded):
    """A stop string, a stop token or max_tokens met inside a step's accepted proposals ends
    the output exactly where decoding one token at a time ends it."""
    plain = build_engine(EngineConfig(loaded, kv_cache_tokens=1024))
    spec = build_engine(EngineConfig(loaded, kv_cache_tokens=1024, speculative_config=NGRAM))
    prompt = "abcabcabcabcabcabc"
    free = _run(plain, [prompt], SamplingParams(temperature=0, max_tokens=30,
                                                ignore_eos=True))[0]
    stop_text = loaded.tokenizer.decode(free[5:8])
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 7)]
    cases += [SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[9]],
                             logprobs=2)]
    for params in cases:
        engine_outputs = []
        for engine in (plain, spec):
            engine.add_request("r", prompt, params)
            while engine.has_unfinished():
                done = [o for o in engine.step() if o.finished]
            engine_outputs.append(done[0].outputs[0])
        a, b = engine_outputs
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason)
        if params.logprobs:
            assert len(b.logprobs) == len(b.token_ids)
            for got, want in zip(b.logprobs, a.logprobs):
                assert got.keys() == want.keys()
                assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
    assert spec.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "draft"])
def test_seeded_samples_do_not_depend_on_speculation(loaded, spec):
    """Each position draws its own noise from the request's generator (rewound past rejected
    rows), so a seeded request's sample is the same with speculation on and off; n > 1 too."""
    # orca-tiny's random weights spread their logits over ~1: low temperatures make them peaked
    # enough for proposals to be accepted at times.
    params = [SamplingParams(temperature=0.1, max_tokens=16, seed=s, ignore_eos=True)
              for s in range(6)] + [SamplingParams(temperature=0.15, n=3, seed=9, max_tokens=12,
                                                   ignore_eos=True)]
    prompts = ["abcabcabcabcabcabc"] * 6 + ["hello hello hello"]
    plain = build_engine(EngineConfig(loaded, kv_cache_tokens=2048))
    engine = build_engine(EngineConfig(loaded, kv_cache_tokens=2048, speculative_config=spec))
    assert _run(engine, prompts, params, check=True) == _run(plain, prompts, params)
    assert engine.stats().spec_num_accepted_tokens > 0


def _chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of the chi-square test that counts ``a`` and ``b`` come from one distribution
    (categories with few expected draws pooled into one)."""
    keep = (a + b) >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    table = np.stack([a, b]).astype(np.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_distribution_is_the_targets(loaded):
    """Thousands of unseeded draws of the first positions a verification decides, with and
    without speculation: a chi-square test finds no difference (and it finds one against a
    different temperature, so it can fail)."""
    prompt = "abababab"
    num_draws, vocab = 1000, loaded.config.vocab_size

    def counts(temperature: float, spec: dict | None) -> np.ndarray:
        torch.manual_seed(0 if spec is None else 1)
        engine = build_engine(EngineConfig(loaded, max_batch_size=128, kv_cache_tokens=4096,
                                           speculative_config=spec))
        params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
        for i in range(num_draws):
            engine.add_request(str(i), prompt, params)
        table = np.zeros((2, vocab), dtype=np.int64)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    for position in (1, 2):
                        table[position - 1, out.outputs[0].token_ids[position]] += 1
        if spec is not None:
            assert engine.stats().spec_num_accepted_tokens > num_draws // 10
        return table

    # At 0.15, orca-tiny's top token has about half the mass (its logits spread over ~1).
    plain, spec = counts(0.15, None), counts(0.15, SELF_DRAFT)
    for position in range(2):
        assert _chi_square_p(plain[position], spec[position]) > 1e-3
    colder = counts(0.1, None)
    assert _chi_square_p(plain[0], colder[0]) < 1e-6


def test_structured_outputs_with_speculation():
    """Proposals the grammar disallows are cut; the constrained outputs match the plain run."""
    pytest.importorskip("llguidance")
    from orca_ext.sampling_params import StructuredOutputsParams

    loaded = model_lib.load_model("orca-tiny", "float32", "cpu")
    params = [SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"(ab){3,8}c"))]
    params.append(SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(
                                     choice=["abcabcabc", "abd"])))
    prompts = ["abababababab", "abcabcabcabc"]
    plain = build_engine(EngineConfig(loaded, kv_cache_tokens=1024))
    spec = build_engine(EngineConfig(loaded, kv_cache_tokens=1024, speculative_config=NGRAM))
    want = _run(plain, prompts, params)
    assert _run(spec, prompts, params, check=True) == want
    assert spec.stats().spec_num_accepted_tokens > 0
    # The cut itself: "ab" twice is allowed by the regex, then "x" is not.
    spec.add_request("cut", "abab", params[0])
    request = next(iter(spec.scheduler.waiting))
    assert spec._allowed_prefix(request, [ord(c) for c in "ababxab"]) == 4
    assert spec._allowed_prefix(request, [ord("c")]) == 0  # (ab){3,8}c: too early
    spec.abort("cut")


def test_ngram_proposal():
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], dtype=np.int64)
    # The latest earlier occurrence of the longest suffix (1 2 3) is followed by 5 6 1 2 3.
    assert ngram_proposal(tokens, 1, 3, 3) == [5, 6, 1]
    assert ngram_proposal(tokens, 1, 3, 10) == [5, 6, 1, 2, 3]
    assert ngram_proposal(np.array([7, 8, 9]), 1, 3, 4) == []
    assert ngram_proposal(np.array([7, 8, 7]), 2, 3, 4) == []  # "8 7" occurs once
    assert ngram_proposal(np.array([7, 8, 7]), 1, 3, 4) == [8, 7]


def test_adaptive_count_follows_acceptance():
    from orca_ext.request import Request
    from orca_ext.spec_decode import Speculator
    from orca_ext.spec_decode.speculator import MARGINAL_TOKEN_COST, best_num_proposals
    from orca_ext.spec_decode.ngram import NgramProposer

    def rate(acceptance: float, k: int) -> float:  # tokens per unit of step time
        return sum(acceptance ** i for i in range(k + 1)) / (1 + MARGINAL_TOKEN_COST * k)

    for acceptance in (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0):
        best = best_num_proposals(acceptance, 7)
        assert rate(acceptance, best) == max(rate(acceptance, k) for k in range(1, 8))
    assert best_num_proposals(1.0, 7) == 7 and best_num_proposals(0.0, 7) == 1

    speculator = Speculator(SpeculativeConfig("ngram", 6), NgramProposer(1, 3))
    request = Request(0, [1, 2], SamplingParams(), 100)
    assert speculator.wanted(request) == 6
    for _ in range(3):
        speculator.record(request, speculator.wanted(request), 0)
    assert speculator.wanted(request) == 1
    for _ in range(4):
        speculator.record(request, speculator.wanted(request), speculator.wanted(request))
    assert speculator.wanted(request) == 6  # copying again: 1, 3, 6, 6
    assert (speculator.num_drafts, speculator.num_accepted_tokens) == (7, 1 + 3 + 6 + 6)
    assert not speculator.eligible(Request(1, [1], SamplingParams(presence_penalty=1.0), 9))
    assert not speculator.eligible(Request(2, [1], SamplingParams(min_tokens=3), 9))


def test_no_speculation_in_compute_bound_batches(loaded):
    """A batch of more tokens than max_batch_tokens gets no proposals."""
    spec = dict(NGRAM, max_batch_tokens=4)
    engine = build_engine(EngineConfig(loaded, kv_cache_tokens=2048, speculative_config=spec))
    for i in range(6):
        engine.add_request(str(i), "abcabcabcabcabc", GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().spec_num_drafts == 0
    engine.add_request("alone", "abcabcabcabcabc", GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().spec_num_drafts > 0


@pytest.mark.parametrize("value, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "'typo'"),
    ("{not json", "JSON"),
])
def test_bad_configs(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig("orca-tiny", device="cpu", speculative_config=value)


def test_config_from_json_and_pipeline_parallel_draft():
    config = EngineConfig("orca-tiny", device="cpu",
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 4, 2)
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig("orca-tiny", device="cpu", pipeline_parallel_size=2,
                     speculative_config={"method": "draft_model", "model": "orca-tiny",
                                         "num_speculative_tokens": 2})


def test_draft_with_another_vocabulary(tmp_path, loaded):
    from tiny_models import make_hf_model, save_hf_model

    folder = save_hf_model(make_hf_model("llama_gqa"), tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        build_engine(EngineConfig(loaded, kv_cache_tokens=256, speculative_config={
            "method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}))


def test_metrics_name_the_counters(loaded):
    pytest.importorskip("prometheus_client")
    from orca_ext.server.metrics import ServerMetrics

    engine = build_engine(EngineConfig(loaded, kv_cache_tokens=1024, speculative_config=NGRAM))
    _run(engine, PROMPTS[:2], GREEDY)

    class Served:  # what the collector reads of an AsyncEngine
        def stats(self):
            return engine.stats()

        def is_healthy(self) -> bool:
            return True

    text = ServerMetrics(Served()).render().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("orca_spec_decode")}
    stats = engine.stats()
    assert values["orca_spec_decode_num_drafts_total"] == stats.spec_num_drafts > 0
    assert values["orca_spec_decode_num_draft_tokens_total"] == stats.spec_num_draft_tokens
    assert values["orca_spec_decode_num_accepted_tokens_total"] == \
        stats.spec_num_accepted_tokens
    assert values["orca_spec_decode_draft_acceptance_rate"] == pytest.approx(
        stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens)


@pytest.mark.slow
def test_pipeline_parallel_ngram(loaded):
    """Two pipeline stages, two batches in flight: the last stage verifies the proposals; the
    outputs are one process's (greedy and seeded sampling)."""
    from orca_ext import LLM
    from orca_ext.distributed import ParallelConfig

    prompts = ["abcabcabcabcabc", "hello hello hello", "The cat sat on the mat. The cat"]
    params = [GREEDY, SamplingParams(temperature=0.1, seed=3, max_tokens=16, ignore_eos=True),
              GREEDY]
    args = dict(dtype="float32", max_batch_size=2, kv_cache_tokens=1024, block_size=8)
    reference = _run(build_engine(EngineConfig(loaded, **args)), prompts, params)
    with LLM("orca-tiny", **args, speculative_config=NGRAM,
             parallel_config=ParallelConfig(1, 2, worker_threads=1)) as llm:
        assert _run(llm.engine, prompts, params) == reference
        assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_serve_flag():
    """``orca-serve --speculative-config JSON`` reaches the engine; a bad one is a ValueError
    naming the value before anything loads."""
    pytest.importorskip("fastapi")
    from orca_ext.distributed import ParallelConfig
    from orca_ext.server.__main__ import build_core, build_parser

    base = ["--model", "orca-tiny", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-tokens", "1024"]
    args = build_parser().parse_args(
        [*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    core, _ = build_core(args, ParallelConfig())
    try:
        assert core.engine.engine.scheduler.speculator.config.num_speculative_tokens == 3
    finally:
        core.engine.shutdown()
    bad = build_parser().parse_args(
        [*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1, got -1"):
        build_core(bad, ParallelConfig())
