"""Model families, KV cache and ModelRunner against Hugging Face transformers."""
from __future__ import annotations

import logging

import pytest
import torch

from orca_ext import ops
from orca_ext.batch import SchedulerOutput
from orca_ext.kv import (KVCache, SlotAllocator, build_metadata, kv_bytes_per_block,
                         num_kv_blocks)
from orca_ext.model import AttentionMetadata, load_model
from orca_ext.runner import ModelRunner
from orca_ext.sampling_params import SamplingParams
from engine_fakes import ScriptedBatches
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
                        atol: float, schedule: list[list[tuple[int, int]]] = SCHEDULE) -> None:
    """``schedule``'s iterations through our model, each request's logits against ``hf``'s on
    its whole sequence (random token ids)."""
    requests = sorted({r for step in schedule for r, _ in step})
    total = {r: sum(n for step in schedule for q, n in step if q == r) for r in requests}
    gen = torch.Generator().manual_seed(seed)
    tokens = {r: torch.randint(0, vocab, (n,), generator=gen) for r, n in total.items()}
    with torch.no_grad():
        expected = {r: hf(t[None]).logits[0] for r, t in tokens.items()}
    blocks = sum(-(-n // block_size) for n in total.values()) + 4
    kv_cache = KVCache(loaded.config, blocks, block_size, torch.float32, device)
    allocator = fragmented_allocator(blocks, block_size)
    done = dict.fromkeys(total, 0)
    for step in schedule:
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


def generate_with_runner(runner: ModelRunner, allocator: SlotAllocator,
                         prompts: list[list[int]], arrivals: list[int],
                         max_new: int) -> list[list[int]]:
    """A scripted stand-in for the scheduler: admit prompts at their iterations, chunk long
    prefills, decode, free finished requests."""
    batches = ScriptedBatches(allocator)
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    running: list[int] = []
    iteration = 0
    while iteration <= max(arrivals) or running:
        for r, arrival in enumerate(arrivals):
            if arrival == iteration:
                allocator.allocate(r, len(prompts[r]) + max_new)
                running.append(r)
        rows = []
        for r in running:
            prompt = prompts[r]
            if computed[r] < len(prompt):
                tokens = prompt[computed[r]:][:CHUNK] if computed[r] == 0 else prompt[computed[r]:]
            else:
                tokens = outputs[r][-1:]
            rows.append((r, tokens, computed[r], GREEDY, len(prompt),
                         computed[r] + len(tokens) >= len(prompt)))
        batch = batches.batch(rows)
        result = runner.execute(batch)
        for request in batch.requests:
            computed[request.request_id] += len(request.token_ids)
        assert result.request_ids == [s.request_id for s in batch.requests if s.sample]
        for r, token in zip(result.request_ids, result.sampled_token_ids):
            outputs[r].append(token)
            if len(outputs[r]) == max_new:
                running.remove(r)
                batches.free(r)
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
                                               device))
    outputs = generate_with_runner(runner, fragmented_allocator(blocks, block_size), prompts,
                                   ARRIVALS, max_new=8)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert output == expected[0, len(prompt):].tolist()


def test_layers_share_their_step_s_attention_plan(monkeypatch):
    """One plan_attention per step (and window) on the CPU; every layer's attention takes it."""
    loaded = load_model("orca-tiny")
    calls = []
    plan_attention = ops.plan_attention
    monkeypatch.setattr(ops, "plan_attention", lambda *args: calls.append(args) or
                        plan_attention(*args))
    kv_cache = KVCache(loaded.config, 8, 16, torch.float32)
    for step in range(2):
        cu, ctx, table, slots, positions = build_metadata([[0, 1]], [10 * step], [10], 16)
        meta = AttentionMetadata(cu, ctx, table, slots)
        with torch.inference_mode():
            loaded.model(torch.arange(10), positions, kv_cache, meta)
        assert len(calls) == step + 1 and len(meta.plans) == 1
    assert loaded.config.num_layers > 1

    loaded = load_model("orca-tiny")
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 8, 4, torch.float32))
    empty = runner.execute(SchedulerOutput(0, []))
    assert (empty.request_ids, empty.sampled_token_ids, empty.logprobs) == ([], [], [])
    prompt = loaded.tokenizer.encode("hello world")
    allocator = SlotAllocator(8, 4)
    allocator.allocate(5, len(prompt) + 1)
    allocator.allocate(6, len(prompt) + 1)
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = runner.execute(ScriptedBatches(allocator).batch([
        (5, prompt[:4], 0, params, len(prompt), False), (6, prompt, 0, params, len(prompt), True)]))
    assert out.request_ids == [6] and len(out.sampled_token_ids) == 1
    assert len(out.logprobs[0].top) == 2
    assert out.logprobs[0].logprob == max(out.logprobs[0].top.values())


# SCHEDULE, then decode steps of 4 and 2 requests and a mixed step of 8 tokens: what the
# DecoderStack runs (up to 8 tokens) and what the model's forward runs.
STACK_SCHEDULE = [*SCHEDULE, [(0, 1), (1, 1), (2, 1), (3, 1)], [(1, 1), (3, 1)],
                  [(0, 1), (1, 5), (2, 2)]]


@pytest.mark.parametrize("block_size,dtype", [(1, torch.float32), (16, torch.float32),
                                              (16, torch.bfloat16)])
def test_stack_runner_matches_the_models_forward(hf_model, block_size, dtype):
    """The runner's DecoderStack (the CPU default, up to 8 tokens a step) gives the model's own
    forward's results bit for bit, over iterations of different sizes: prefills, a chunk with
    nothing sampled, decodes, a mixed step."""
    _, folder = hf_model
    loaded = load_model(str(folder), dtype=dtype)
    params = SamplingParams(temperature=0.0, logprobs=3)
    total = {r: sum(n for step in STACK_SCHEDULE for q, n in step if q == r) for r in range(4)}
    gen = torch.Generator().manual_seed(block_size)
    tokens = {r: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for r, n in total.items()}
    blocks = sum(-(-n // block_size) for n in total.values())
    allocator = SlotAllocator(blocks, block_size)
    for r, n in total.items():
        allocator.allocate(r, n)
    runners = [ModelRunner(loaded.model, KVCache(loaded.config, blocks, block_size, dtype),
                           decoder_stack=stack) for stack in (False, True)]
    assert runners[0].stack is None and runners[1].stack is not None
    scripts = [ScriptedBatches(allocator) for _ in runners]
    done = dict.fromkeys(total, 0)
    for step in STACK_SCHEDULE:
        rows = []
        for r, n in step:
            rows.append((r, tokens[r][done[r]:done[r] + n], done[r], params, 16,
                         (r, n) != (1, 3)))
            done[r] += n
        eager, stacked = (runner.execute(script.batch(rows))
                          for runner, script in zip(runners, scripts))
        assert stacked.request_ids == eager.request_ids
        assert stacked.sampled_token_ids == eager.sampled_token_ids
        assert stacked.logprobs == eager.logprobs


def test_stack_sees_in_place_weight_updates(hf_model):
    """The stack holds the live parameter tensors (not copies): a weight changed in place after
    it was built changes its results exactly as the model's forward's."""
    _, folder = hf_model
    loaded = load_model(str(folder))
    params = SamplingParams(temperature=0.0, logprobs=3)
    prompt = list(range(1, 8))  # one step of 7 tokens: the stack runs it
    runners = [ModelRunner(loaded.model, KVCache(loaded.config, 4, 4, torch.float32),
                           decoder_stack=stack) for stack in (False, True)]
    allocator = SlotAllocator(4, 4)

    def prefill() -> list:
        outputs = []
        for runner in runners:
            allocator.allocate(0, len(prompt))
            batches = ScriptedBatches(allocator)
            out = runner.execute(batches.batch([(0, prompt, 0, params, len(prompt), True)]))
            batches.free(0)
            runner.execute(batches.batch([]))
            outputs.append((out.sampled_token_ids, out.logprobs))
        return outputs

    eager_before, stacked_before = prefill()
    assert stacked_before == eager_before
    with torch.no_grad():
        for p in loaded.model.layers[0].parameters():
            p.mul_(-1.5)
    eager_after, stacked_after = prefill()
    assert eager_after != eager_before
    assert stacked_after == eager_after


def test_execute_runs_in_inference_mode_and_restores_the_callers_mode():
    loaded = load_model("orca-tiny")
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 8, 4, torch.float32))
    allocator = SlotAllocator(8, 4)
    allocator.allocate(0, 6)
    seen = []
    forward = runner.forward
    runner.forward = lambda inputs: seen.append(torch.is_inference_mode_enabled()) or forward(
        inputs)
    out = runner.execute(ScriptedBatches(allocator).batch([(0, [1, 2, 3], 0, GREEDY, 3, True)]))
    assert len(out.sampled_token_ids) == 1 and seen == [True]
    assert not torch.is_inference_mode_enabled()


def test_runner_logs_how_steps_run(caplog):
    """One decision per runner, logged: the stack for a plain model, the model's own forward
    for anything else (with the reason)."""

    class Wrapped(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            return self.model(*args)

        def compute_logits(self, hidden, indices):
            return self.model.compute_logits(hidden, indices)

    loaded = load_model("orca-tiny")
    cache = KVCache(loaded.config, 8, 4, torch.float32)
    with caplog.at_level(logging.INFO, logger="orca_ext.runner"):
        ModelRunner(loaded.model, cache)
        runner = ModelRunner(Wrapped(loaded.model), cache)
    assert runner.stack is None
    assert ("steps of up to 8 tokens run GPT2LMHeadModel's 8 blocks as one DecoderStack"
            in caplog.text)
    assert ("every step runs Wrapped's own forward (no DecoderStack: Wrapped is not a plain "
            "Decoder" in caplog.text)
    allocator = SlotAllocator(8, 4)
    allocator.allocate(0, 6)
    out = runner.execute(ScriptedBatches(allocator).batch([(0, [1, 2, 3], 0, GREEDY, 3, True)]))
    assert out.request_ids == [0] and len(out.sampled_token_ids) == 1


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
    assert model.lm_head.weight is model.embed.weight


def test_inner_layers_refuse_forward_hooks():
    """Inner layers call forward directly (no hook machinery on the decode path), so a hook
    would never run: registering one is an error, while the top-level model still takes one."""
    model = load_model("orca-tiny").model
    with pytest.raises(RuntimeError, match="runs no hooks"):
        model.layers[0].attn.qkv.register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="runs no hooks"):
        model.layers[0].register_forward_pre_hook(lambda *args: None)
    model.register_forward_hook(lambda *args: None).remove()
