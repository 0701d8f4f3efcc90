"""Model families, KV cache and ModelRunner against Hugging Face transformers."""
from __future__ import annotations

import pytest
import torch

from orca_ext.batch import ScheduledRequest, SchedulerOutput
from orca_ext.executor import KVCache, ModelRunner, kv_bytes_per_block, num_kv_blocks
from orca_ext.kv import SlotAllocator
from orca_ext.model import AttentionMetadata, load_model
from orca_ext.sampling_params import SamplingParams
from tiny_models import SPECS, VOCAB, make_hf_model, save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module", params=list(SPECS))
def hf_model(request, tmp_path_factory):
    """(transformers model, its saved folder) for each tiny model family variant."""
    model = make_hf_model(request.param)
    return model, save_hf_model(model, tmp_path_factory.mktemp(request.param))


def fragmented_allocator(num_blocks: int, block_size: int) -> SlotAllocator:
    """An allocator whose free list is out of order, so block tables are not 0, 1, 2..."""
    allocator = SlotAllocator(num_blocks, block_size)
    for dummy in range(4):
        allocator.allocate(1000 + dummy, block_size)
    for dummy in (1, 3, 0, 2):
        allocator.free(1000 + dummy)
    return allocator


# Each iteration: (request, new tokens) in packed order. Mixes prefills, a prefill split in two
# chunks (request 1), and decodes, in varying orders.
SCHEDULE = [
    [(0, 13), (1, 3)],
    [(0, 1), (1, 2), (2, 9)],
    [(2, 1), (0, 1), (3, 7), (1, 1)],
    [(3, 1), (1, 1), (2, 1)],
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_packed_logits_match_transformers(hf_model, block_size, device):
    hf, folder = hf_model
    check_packed_logits(load_model(str(folder), device=device), hf, VOCAB, block_size, device,
                        seed=block_size, atol=1e-4)


def check_packed_logits(loaded, hf, vocab: int, block_size: int, device: str, seed: int,
                        atol: float) -> None:
    """SCHEDULE's iterations through our model, each request's logits against ``hf``'s on its
    whole sequence (random token ids)."""
    total = {r: sum(n for step in SCHEDULE for q, n in step if q == r) for r in range(4)}
    gen = torch.Generator().manual_seed(seed)
    tokens = {r: torch.randint(0, vocab, (n,), generator=gen) for r, n in total.items()}
    with torch.no_grad():
        expected = {r: hf(t[None]).logits[0] for r, t in tokens.items()}
    blocks = sum(-(-n // block_size) for n in total.values()) + 4
    kv_cache = KVCache(loaded.config, blocks, block_size, torch.float32, device)
    allocator = fragmented_allocator(blocks, block_size)
    done = dict.fromkeys(total, 0)
    for step in SCHEDULE:
        for r, _ in step:
            if r not in allocator:
                allocator.allocate(r, total[r])
        ids = [r for r, _ in step]
        num_new = [n for _, n in step]
        metadata = [t.to(device) for t in allocator.build_metadata(
            ids, [done[r] for r in ids], num_new)]
        input_ids = torch.cat([tokens[r][done[r]:done[r] + n] for r, n in step]).to(device)
        with torch.inference_mode():
            hidden = loaded.model(input_ids, metadata[4], kv_cache,
                                  AttentionMetadata(*metadata[:4]))
            logits = loaded.model.compute_logits(
                hidden, torch.arange(input_ids.shape[0], device=device)).cpu()
        row = 0
        for r, n in step:
            torch.testing.assert_close(logits[row:row + n], expected[r][done[r]:done[r] + n],
                                       atol=atol, rtol=1e-4)
            row += n
            done[r] += n


PROMPT_LENS = [5, 11, 3, 17, 8, 1, 13, 6, 9]
ARRIVALS = [0, 0, 1, 2, 2, 3, 5, 6, 9]  # iteration at which each prompt is admitted
CHUNK = 8  # prompts longer than this are prefilled in two iterations


def generate_with_runner(runner: ModelRunner, prompts: list[list[int]], arrivals: list[int],
                         max_new: int) -> list[list[int]]:
    """A scripted stand-in for the scheduler: admit prompts at their iterations, chunk long
    prefills, decode, free finished requests."""
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    running: list[int] = []
    finished: list[int] = []
    iteration = 0
    while iteration <= max(arrivals) or running:
        for r, arrival in enumerate(arrivals):
            if arrival == iteration:
                runner.allocator.allocate(r, len(prompts[r]) + max_new)
                running.append(r)
        scheduled = []
        for r in running:
            prompt = prompts[r]
            if computed[r] < len(prompt):
                tokens = prompt[computed[r]:][:CHUNK] if computed[r] == 0 else prompt[computed[r]:]
            else:
                tokens = outputs[r][-1:]
            scheduled.append(ScheduledRequest(
                r, tokens, computed[r], GREEDY, prompt, outputs[r],
                sample=computed[r] + len(tokens) >= len(prompt)))
        result = runner.execute(SchedulerOutput(iteration, scheduled, finished))
        finished = []
        for request in scheduled:
            computed[request.request_id] += len(request.token_ids)
        assert result.request_ids == [s.request_id for s in scheduled if s.sample]
        for r, token in zip(result.request_ids, result.sampled_token_ids):
            outputs[r].append(token)
            if len(outputs[r]) == max_new:
                running.remove(r)
                runner.allocator.free(r)
                finished.append(r)
        iteration += 1
    return outputs


def test_greedy_generation_matches_transformers(hf_model, device):
    hf, folder = hf_model
    loaded = load_model(str(folder), device=device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    block_size = 4
    blocks = num_kv_blocks(loaded.config, block_size, torch.float32,
                           kv_cache_tokens=sum(PROMPT_LENS) + 8 * len(PROMPT_LENS))
    runner = ModelRunner(loaded.model, KVCache(loaded.config, blocks, block_size, torch.float32,
                                               device),
                         fragmented_allocator(blocks, block_size))
    outputs = generate_with_runner(runner, prompts, ARRIVALS, max_new=8)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert output == expected[0, len(prompt):].tolist()


def test_runner_skips_unsampled_and_empty_batches():
    loaded = load_model("orca-tiny")
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 8, 4, torch.float32),
                         SlotAllocator(8, 4))
    empty = runner.execute(SchedulerOutput(0, []))
    assert (empty.request_ids, empty.sampled_token_ids, empty.logprobs) == ([], [], [])
    prompt = loaded.tokenizer.encode("hello world")
    runner.allocator.allocate(5, len(prompt) + 1)
    runner.allocator.allocate(6, len(prompt) + 1)
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = runner.execute(SchedulerOutput(1, [
        ScheduledRequest(5, prompt[:4], 0, params, prompt, [], sample=False),
        ScheduledRequest(6, prompt, 0, params, prompt, []),
    ]))
    assert out.request_ids == [6] and len(out.sampled_token_ids) == 1
    assert len(out.logprobs[0].top) == 2
    assert out.logprobs[0].logprob == max(out.logprobs[0].top.values())


@pytest.mark.parametrize("block_size,dtype", [(1, torch.float32), (16, torch.float32),
                                              (16, torch.bfloat16)])
def test_traced_runner_matches_eager(hf_model, block_size, dtype):
    """The TorchScript replay (the CPU default) gives the eager forward's results bit for bit,
    over iterations of different sizes: prefills, a chunk with nothing sampled, decodes."""
    _, folder = hf_model
    loaded = load_model(str(folder), dtype=dtype)
    params = SamplingParams(temperature=0.0, logprobs=3)
    total = {r: sum(n for step in SCHEDULE for q, n in step if q == r) for r in range(4)}
    gen = torch.Generator().manual_seed(block_size)
    tokens = {r: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for r, n in total.items()}
    blocks = sum(-(-n // block_size) for n in total.values())
    runners = [ModelRunner(loaded.model, KVCache(loaded.config, blocks, block_size, dtype),
                           SlotAllocator(blocks, block_size), trace=trace)
               for trace in (False, True)]
    assert runners[0].traced is None and runners[1].traced is not None
    for runner in runners:
        for r, n in total.items():
            runner.allocator.allocate(r, n)
    done = dict.fromkeys(total, 0)
    for iteration, step in enumerate(SCHEDULE):
        scheduled = []
        for r, n in step:
            scheduled.append(ScheduledRequest(r, tokens[r][done[r]:done[r] + n], done[r], params,
                                              tokens[r], [], sample=(r, n) != (1, 3)))
            done[r] += n
        eager, traced = (runner.execute(SchedulerOutput(iteration, scheduled))
                         for runner in runners)
        assert traced.request_ids == eager.request_ids
        assert traced.sampled_token_ids == eager.sampled_token_ids
        assert traced.logprobs == eager.logprobs


def test_traced_runner_sees_in_place_weight_updates(hf_model):
    """The trace holds the live parameter tensors (not copies): a weight changed in place after
    tracing changes the traced results exactly as the eager ones."""
    _, folder = hf_model
    loaded = load_model(str(folder))
    params = SamplingParams(temperature=0.0, logprobs=3)
    prompt = list(range(1, 12))
    runners = [ModelRunner(loaded.model, KVCache(loaded.config, 4, 4, torch.float32),
                           SlotAllocator(4, 4), trace=trace) for trace in (False, True)]

    def prefill() -> list:
        outputs = []
        for runner in runners:
            runner.allocator.allocate(0, len(prompt))
            out = runner.execute(SchedulerOutput(0, [ScheduledRequest(0, prompt, 0, params,
                                                                      prompt, [])]))
            runner.allocator.free(0)
            outputs.append((out.sampled_token_ids, out.logprobs))
        return outputs

    eager_before, traced_before = prefill()
    assert traced_before == eager_before
    with torch.no_grad():
        for p in loaded.model.layers[0].parameters():
            p.mul_(-1.5)
    eager_after, traced_after = prefill()
    assert eager_after != eager_before
    assert traced_after == eager_after


@pytest.mark.parametrize("caller_flag", [True, False])
def test_traced_iteration_runs_unoptimized_in_inference_mode(caller_flag):
    """The trace runs in inference mode with the graph executor's optimizations off (no
    profiling runs or passes specialized on one batch's sizes), and the caller's settings are
    back afterwards, also when the graph raises."""
    loaded = load_model("orca-tiny")
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 8, 4, torch.float32),
                         SlotAllocator(8, 4))
    traced_graph, seen = runner.traced.graph, []

    def spy(*args):
        seen.append((torch._C._get_graph_executor_optimize(), torch.is_inference_mode_enabled()))
        if len(seen) == 2:
            raise RuntimeError("graph failed")
        return traced_graph(*args)

    runner.traced.graph = spy
    runner.allocator.allocate(0, 6)
    step = SchedulerOutput(0, [ScheduledRequest(0, [1, 2, 3], 0, GREEDY, [1, 2, 3], [])])
    saved = torch._C._get_graph_executor_optimize()
    torch._C._set_graph_executor_optimize(caller_flag)
    try:
        assert len(runner.execute(step).sampled_token_ids) == 1
        assert torch._C._get_graph_executor_optimize() is caller_flag
        assert not torch.is_inference_mode_enabled()
        with pytest.raises(RuntimeError, match="graph failed"):
            runner.execute(step)
        assert torch._C._get_graph_executor_optimize() is caller_flag
        assert not torch.is_inference_mode_enabled()
    finally:
        torch._C._set_graph_executor_optimize(saved)
    assert seen == [(False, True), (False, True)]


def test_runner_runs_eagerly_when_tracing_fails(caplog):
    class Untraceable(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            if torch.jit.is_tracing():
                raise RuntimeError("not traceable")
            return self.model(*args)

        def compute_logits(self, hidden, indices):
            return self.model.compute_logits(hidden, indices)

    loaded = load_model("orca-tiny")
    runner = ModelRunner(Untraceable(loaded.model), KVCache(loaded.config, 8, 4, torch.float32),
                         SlotAllocator(8, 4))
    assert runner.traced is None
    assert "running Untraceable eagerly: tracing its forward failed (not traceable)" in caplog.text
    runner.allocator.allocate(0, 6)
    out = runner.execute(SchedulerOutput(0, [ScheduledRequest(0, [1, 2, 3], 0, GREEDY,
                                                              [1, 2, 3], [])]))
    assert out.request_ids == [0] and len(out.sampled_token_ids) == 1


def test_runner_rejects_mismatched_allocator():
    loaded = load_model("orca-tiny")
    with pytest.raises(ValueError, match="allocator"):
        ModelRunner(loaded.model, KVCache(loaded.config, 8, 4, torch.float32),
                    SlotAllocator(8, 16))


def test_kv_cache_layout_and_budget():
    config = load_model("orca-tiny").config
    cache = KVCache(config, num_blocks=6, block_size=4, dtype=torch.bfloat16)
    assert len(cache) == config.num_layers and cache.num_tokens == 24
    k, v = cache[3]
    assert k.shape == v.shape == (6, 4, config.num_kv_heads, config.head_dim)
    assert k.is_contiguous() and v.is_contiguous() and k.dtype == torch.bfloat16
    per_block = kv_bytes_per_block(config, 4, torch.bfloat16)
    assert per_block == 2 * config.num_layers * 4 * config.hidden_size * 2
    assert num_kv_blocks(config, 4, torch.bfloat16, kv_cache_tokens=9) == 3
    assert num_kv_blocks(config, 4, torch.bfloat16, kv_cache_memory=3 * per_block + 1) == 3
    with pytest.raises(ValueError, match="exactly one"):
        num_kv_blocks(config, 4, torch.float32)
    with pytest.raises(ValueError, match="exactly one"):
        num_kv_blocks(config, 4, torch.float32, kv_cache_tokens=8, kv_cache_memory=10 ** 6)
    with pytest.raises(ValueError, match="less than one KV block"):
        num_kv_blocks(config, 4, torch.float32, kv_cache_memory=10)
    with pytest.raises(ValueError, match="block_size"):
        num_kv_blocks(config, 0, torch.float32, kv_cache_tokens=8)


def test_cpu_weights_share_one_huge_page_aligned_buffer_in_forward_order():
    """The arena (orca_ext/model/arena.py): every parameter, a tied one once, is a slice of one
    2 MB-aligned buffer, laid out in registration order without overlap."""
    model = load_model("orca-tiny").model
    params = list(dict.fromkeys(model.parameters()))
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1
    assert params[0].data_ptr() % (2 << 20) == 0
    for a, b in zip(params, params[1:]):
        assert a.data_ptr() + a.nbytes <= b.data_ptr()
    assert model.lm_head.weight is model.wte.weight


def test_inner_layers_refuse_forward_hooks():
    """Inner layers call forward directly (no hook machinery on the decode path), so a hook
    would never run: registering one is an error, while the top-level model still takes one."""
    model = load_model("orca-tiny").model
    with pytest.raises(RuntimeError, match="runs no hooks"):
        model.layers[0].attn.qkv.register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="runs no hooks"):
        model.layers[0].register_forward_pre_hook(lambda *args: None)
    model.register_forward_hook(lambda *args: None).remove()
