"""The int8 KV cache (kv_cache_dtype="int8"): store_kv's rows against the reference quantizer,
ragged_attention over them against float64 attention on the dequantized cache (every CPU path),
the memory plan's counts, the engine end to end, and bad configurations."""
from __future__ import annotations

import pytest
import torch

import reference_ops as ref
from orca_ext import LLM, EngineConfig, SamplingParams, _C, build_engine, ops
from orca_ext.kv import KVCache, kv_bytes_per_block, num_kv_blocks, resolve_kv_cache_dtype
from orca_ext.kv.cache import plan_kv_blocks
from orca_ext.model import ModelConfig, load_model
from orca_ext.testing import random_ragged_batch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [40, 64])
def test_store_kv_writes_the_reference_rows(dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks, H, T = 32, 3, 20
    k_cache = torch.zeros(num_blocks, block_size, H, head_dim + 4, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    key, value = (torch.randn(T, H, head_dim, generator=gen).mul(3).to(dtype) for _ in range(2))
    key[2, 1] = 0  # an all-zero row: scale 0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[::5] = -1  # skipped tokens
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(ref.quantize_kv_int8(key, keys=True), ref.quantize_kv_int8(value), want_k,
                 want_v, slots)
    ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # Round trip: each value of V, and of the rotated key H k, within half a step (the scale,
    # rounded to float32) of itself; H undone, the key's error has the same norm.
    kept = slots >= 0
    for cache, x, keys in ((v_cache, value, False), (k_cache, key, True)):
        rows = cache.view(-1, H, head_dim + 4)[slots[kept]]
        y, norm = ref.hadamard_rows(x[kept].float()) if keys else (x[kept], torch.tensor(1.0))
        y = y.double() * norm.double()
        step = y.abs().amax(-1, keepdim=True) / 127
        error = ref.dequantize_kv_int8(rows) - y
        assert (error.abs() <= step * (0.5 + 1e-4)).all()
        back = ref.dequantize_kv_int8(rows, keys) - x[kept].double()
        torch.testing.assert_close(back.norm(dim=-1), error.norm(dim=-1), rtol=1e-4, atol=1e-6)


def test_rotated_keys_spread_an_outlier_channel():
    """Rows with one channel 30x the rest: stored as keys (rotated), their error is a fraction
    of theirs stored as values (the outlier's step over every channel)."""
    x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(0))
    x[..., 5] *= 30
    k_cache = torch.zeros(64, 1, 2, 68, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    ops.store_kv(x, x, k_cache, v_cache, torch.arange(64))
    key_error = ref.dequantize_kv_int8(k_cache[:, 0], keys=True) - x.double()
    value_error = ref.dequantize_kv_int8(v_cache[:, 0]) - x.double()
    assert key_error.norm() < 0.3 * value_error.norm()


def test_store_kv_strided_views_into_int8():
    qkv = torch.randn(5, 3, 2, 32)
    k_cache = torch.zeros(4, 2, 2, 36, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 3, 5, 6, 7])
    ops.store_kv(qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(8, 2, 36)[slots], ref.quantize_kv_int8(qkv[:, 1], keys=True))
    assert torch.equal(v_cache.view(8, 2, 36)[slots], ref.quantize_kv_int8(qkv[:, 2]))


# ---------------------------------------------------------------------------- ragged_attention

ATTENTION_ISAS = ["portable", "avx512bf16", "amx"]


@pytest.fixture(params=ATTENTION_ISAS)
def attention_isa(request, force_isa) -> str:
    if request.param not in _C.attention_isas():
        pytest.skip(f"this build or CPU does not run the {request.param} attention path")
    force_isa("attention", request.param)
    return request.param


# Decodes (the direct kernel; long contexts split and merged), prefills and chunks over cached
# KV (the float lanes), and both mixed.
MIXES = {
    "decode": ([1, 1, 1, 1], [1, 17, 130, 3000]),
    "prefill": ([5, 70, 1], [5, 70, 1]),
    "mixed": ([1, 40, 1, 9, 1, 130], [70, 40, 3, 30, 257, 700]),
}


def int8_batch(mix: str, heads: tuple[int, int], head_dim: int, block_size: int,
               dtype: torch.dtype):
    """A random batch with its caches quantized to int8, and the float64 dequantized caches."""
    batch = random_ragged_batch(*MIXES[mix], *heads, head_dim, block_size, dtype=dtype)
    k8, v8 = ref.quantize_kv_int8(batch.k_cache, keys=True), ref.quantize_kv_int8(batch.v_cache)
    return batch, k8, v8, ref.dequantize_kv_int8(k8, keys=True), ref.dequantize_kv_int8(v8)


def check_int8_attention(mix, heads, head_dim, block_size, dtype, window=0):
    batch, k8, v8, k64, v64 = int8_batch(mix, heads, head_dim, block_size, dtype)
    meta = (batch.cu_q_lens, batch.context_lens, batch.block_table, batch.scale, window)
    out = ops.ragged_attention(batch.q, k8, v8, *meta)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert_close(out, ref.ragged_attention(batch.q, k64, v64, *meta), dtype)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])  # 40: the scalar path
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_attention_against_the_dequantized_cache(attention_isa, mix, heads, head_dim,
                                                      dtype):
    check_int8_attention(mix, heads, head_dim, 16, dtype)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
@pytest.mark.parametrize("block_size", [1, 64])
def test_int8_attention_head_dims_and_blocks(head_dim, block_size):
    check_int8_attention("mixed", (6, 2), head_dim, block_size, torch.float32)


@pytest.mark.parametrize("window", [1, 7, 100, 4096])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_attention_sliding_window(attention_isa, window, mix, dtype):
    check_int8_attention(mix, (8, 2), 64, 16, dtype, window)


def test_int8_cache_errors_name_the_problem():
    batch, k8, v8, _, _ = int8_batch("decode", (4, 2), 32, 16, torch.float32)
    meta = (batch.cu_q_lens, batch.context_lens, batch.block_table, batch.scale)
    with pytest.raises(RuntimeError, match=r"v_cache has dtype Float but k_cache has dtype Char"):
        ops.ragged_attention(batch.q, k8, batch.v_cache, *meta)
    with pytest.raises(RuntimeError, match=r"k_cache head_dim 28 must equal q head_dim 32 "
                                           r"\(an int8 cache's rows are head_dim \+ 4 bytes\)"):
        ops.ragged_attention(batch.q, k8[..., 4:].contiguous(), v8[..., 4:].contiguous(), *meta)
    key = torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match=r"the cache holds \[Hkv, D\] = \[2, 28\]"):
        ops.store_kv(key, key, k8[..., 4:].contiguous(), v8[..., 4:].contiguous(),
                     torch.tensor([0, 1]))
    wide = torch.zeros(2, 2, 2, 264, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"int8 k_cache rows hold head_dim <= 256 values, got "
                                           r"head_dim 260"):
        ops.store_kv(torch.randn(2, 2, 260), torch.randn(2, 2, 260), wide, wide.clone(),
                     torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="key must be float32, bfloat16 or float16"):
        ops.store_kv(key.to(torch.int8), key.to(torch.int8), k8, v8, torch.tensor([0, 1]))


def test_opcheck_int8_cache():
    batch, k8, v8, _, _ = int8_batch("mixed", (4, 2), 32, 16, torch.float32)
    torch.library.opcheck(torch.ops.orca.ragged_attention.default,
                          (batch.q, k8, v8, batch.cu_q_lens, batch.context_lens,
                           batch.block_table, batch.scale))
    key = torch.randn(3, 2, 32)
    torch.library.opcheck(torch.ops.orca.store_kv.default,
                          (key, key, k8.clone(), v8.clone(), torch.tensor([0, 5, -1])))


# ---------------------------------------------------------------------------- the memory plan

SMOLLM2 = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "max_position_embeddings": 8192})


def test_memory_plan_counts_int8_rows_and_scales():
    per_block = kv_bytes_per_block(SMOLLM2, 16, torch.int8)
    assert per_block == 2 * 30 * 16 * 3 * (64 + 4)
    memory = 2**30
    blocks = {dtype: num_kv_blocks(SMOLLM2, 16, dtype, kv_cache_memory=memory)
              for dtype in (torch.float32, torch.bfloat16, torch.int8)}
    assert blocks[torch.int8] == memory // per_block
    # 4 x 64 / 68 of float32's tokens, 2 x 64 / 68 of bfloat16's.
    assert 3.7 < blocks[torch.int8] / blocks[torch.float32] < 3.8
    assert 1.85 < blocks[torch.int8] / blocks[torch.bfloat16] < 1.9
    planned, _ = plan_kv_blocks(SMOLLM2, 16, torch.int8, "cpu", 1, 8192, kv_cache_memory=memory)
    assert planned == blocks[torch.int8]


def test_kv_cache_allocates_int8_rows():
    config = load_model("orca-tiny").config
    cache = KVCache(config, 3, 4, torch.int8)
    k, v = cache[0]
    assert k.dtype == torch.int8 and k.shape == (3, 4, config.num_kv_heads, config.head_dim + 4)
    assert cache.storage.numel() == 3 * kv_bytes_per_block(config, 4, torch.int8)


# ---------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("name,dtype,device,message", [
    ("int4", torch.float32, "cpu", "kv_cache_dtype: 'int4' is not one of 'auto', 'int8', "
                                   "'fp8', 'fp8_e4m3'"),
    ("int8", torch.float32, "cuda", "kv_cache_dtype: 'int8' runs on cpu only, got device 'cuda'"),
    ("fp8_e4m3", torch.float32, "cpu", "kv_cache_dtype: 'fp8_e4m3' runs on cuda only"),
    ("fp8", torch.bfloat16, "cpu", "kv_cache_dtype: 'fp8' runs on cuda only"),
    ("int8", torch.float64, "cpu", "kv_cache_dtype: 'int8' needs float32, bfloat16 or float16 "
                                   "activations, got torch.float64"),
])
def test_bad_kv_cache_dtypes_name_the_value(name, dtype, device, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_kv_cache_dtype(name, dtype, device)


def test_engine_config_checks_kv_cache_dtype():
    config = EngineConfig("orca-tiny", device="cpu").resolved()
    assert config.kv_dtype() == config.dtype
    assert EngineConfig("orca-tiny", device="cpu",
                        kv_cache_dtype="int8").resolved().kv_dtype() == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8_e5m2' is not one of"):
        EngineConfig("orca-tiny", device="cpu", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8_e4m3' runs on cuda only"):
        EngineConfig("orca-tiny", device="cpu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int8' runs in one process"):
        EngineConfig("orca-tiny", device="cpu", kv_cache_dtype="int8", tensor_parallel_size=2)
    # The prefix cache never serves one cache dtype's KV to another.
    assert EngineConfig("orca-tiny", kv_cache_dtype="int8").prefix_cache_salt() != \
        EngineConfig("orca-tiny").prefix_cache_salt()


# ---------------------------------------------------------------------------- the engine

PROMPTS = ["Hello, my name is", "The capital of France is", "a" * 40, "Orca", "x",
           "The capital of France is Paris"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model("orca-tiny", "float32", "cpu")


def outputs_one_at_a_time(loaded, kv_cache_dtype: str) -> list[list[int]]:
    llm = LLM(loaded, max_batch_size=1, kv_cache_tokens=512, kv_cache_dtype=kv_cache_dtype,
              enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kwargs", [
    dict(policy="orca", max_batch_size=16, kv_cache_tokens=2048),
    dict(policy="orca", max_batch_size=3, kv_cache_tokens=2048, block_size=1),
    dict(policy="request", max_batch_size=4, kv_cache_tokens=2048),
    dict(policy="paged", max_batch_size=8, kv_cache_tokens=64, block_size=8),  # preempts
    dict(policy="paged", max_batch_size=8, kv_cache_tokens=1024, max_num_batched_tokens=16),
], ids=["orca", "orca-bs3-block1", "request", "paged-preempt", "paged-chunked"])
def test_engine_with_int8_kv_every_policy(loaded, kwargs):
    """Every policy (prefix hits under orca and paged: two prompts share a prefix; preemption,
    chunked prefills) gives the int8 cache's one-at-a-time greedy outputs, and those mostly agree
    with the float32 cache's."""
    expected = outputs_one_at_a_time(loaded, "int8")
    engine = build_engine(EngineConfig(loaded, kv_cache_dtype="int8", **kwargs))
    assert engine.executor.kv_cache.dtype == torch.int8
    for i, prompt in enumerate(PROMPTS):  # staggered arrivals: one new request per step
        engine.add_request(str(i), prompt, GREEDY)
        engine.step()
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    got = [finished[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]
    assert got == expected
    if kwargs.get("kv_cache_tokens") == 64:
        assert engine.stats().num_preemptions > 0
    assert engine.stats().num_used_blocks == 0
    float_outputs = outputs_one_at_a_time(loaded, "auto")
    same = sum(a == b for x, y in zip(got, float_outputs) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, got))
