"""CUDA-only checks of the torch.ops.orca kernels and the GPU runner (skipped without a GPU).

The device-parametrized reference tests are in test_ops.py; these add what only the CUDA path
has: the tensor-core attention kernels (bf16/fp16, every supported head dim, decode / prefill /
split-KV work partitions), batches that give each CTA many work items (B = 512, a grid capped
by cuda_test_limits, B at the kernel's limit), a 4096-token prefill, a KV cache past 2^31
elements, bitwise repeatability and partition invariance, the skinny and cuBLASLt linear paths
and the cuBLASLt-less fallback, launches from several host threads, opcheck on CUDA, memory
safety with invalid metadata, a decode step (packed_linear -> store_kv -> ragged_attention)
captured in a CUDA graph and replayed with new metadata (which would fail if an op read device
values on the host or synchronized), and the runner's decode iterations from CUDA graphs against
its eager ones, and the fp8 e4m3 KV cache (store_kv's rounding against torch's cast, every
attention kernel against the dequantized cache, the runner and the engine on it).
"""
import dataclasses
import threading

import pytest
import torch

import orca_ext
import reference_ops as ref
from engine_fakes import ScriptedBatches
from orca_ext import LLM, ops
from orca_ext.kv import KVCache, SlotAllocator
from orca_ext.model import load_model
from orca_ext.runner import ModelRunner
from orca_ext.sampling_params import SamplingParams
from orca_ext.testing import cuda_test_limits, random_ragged_batch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and orca_ext.has_cuda()),
    reason="needs a GPU and a CUDA build of orca_ext")

TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


def reference(batch, window=0):
    return ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()),
                                window)


def device_reference(batch):
    """float64 attention computed on the GPU, one request at a time (for large cases)."""
    q, k_cache, v_cache = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    cu, ctx = batch.cu_q_lens.tolist(), batch.context_lens.tolist()
    for r, c in enumerate(ctx):
        n = cu[r + 1] - cu[r]
        if n == 0:
            continue
        pos = torch.arange(c, device=q.device)
        slots = batch.block_table[r].long()[pos // bs] * bs + pos % bs
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[r]:cu[r + 1]], k) * batch.scale
        q_pos = torch.arange(c - n, c, device=q.device)[:, None]
        scores.masked_fill_(pos[None, :] > q_pos, float("-inf"))
        out[cu[r]:cu[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def decode_reference(batch):
    """float64 attention of a decode-only batch (one query per request), all requests at once."""
    q, k_cache, v_cache = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    B, hq, d = q.shape
    ctx = batch.context_lens.long()
    pos = torch.arange(int(ctx.max()), device=q.device)
    valid = pos[None, :] < ctx[:, None]                                   # [B, L]
    blocks = batch.block_table.long().gather(1, (pos // bs)[None].expand(B, -1).clamp(
        max=batch.block_table.shape[1] - 1))
    slots = torch.where(valid, blocks * bs + pos % bs, 0)
    k = k_cache.flatten(0, 1)[slots].repeat_interleave(hq // hkv, dim=2)  # [B, L, Hq, D]
    v = v_cache.flatten(0, 1)[slots].repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q, k) * batch.scale
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), v).view(B, hq, d)


def attend(batch, **overrides):
    args = list(batch.args())
    for i, name in enumerate(("q", "k_cache", "v_cache", "cu_q_lens", "context_lens",
                              "block_table")):
        if name in overrides:
            args[i] = overrides[name]
    out = ops.ragged_attention(*args)
    torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------------------- ragged_attention

MIXES = {
    "decode": ([1] * 6, [1, 17, 64, 65, 130, 300]),
    "prefill": ([5, 64, 33, 1], [5, 64, 33, 1]),
    "mixed": ([1, 40, 1, 9, 1, 100], [70, 40, 3, 30, 257, 180]),
    "long-decode": ([1, 1, 1], [3000, 1100, 40]),        # split-KV + merge
    "long-prefill": ([300, 1], [1200, 2500]),             # chunked prefill over cached KV
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("heads,block_size", [((8, 2), 16), ((4, 4), 1), ((8, 1), 5)])
def test_attention_tensor_cores(dtype, head_dim, mix, heads, block_size):
    q_lens, ctx = MIXES[mix]
    batch = random_ragged_batch(q_lens, ctx, *heads, head_dim, block_size, dtype=dtype,
                                device="cuda", seed=head_dim)
    out = ops.ragged_attention(*batch.args())
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_close(out, reference(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [40, 256])  # no tensor-core kernel: the simple kernel
def test_attention_other_head_dims(dtype, head_dim):
    batch = random_ragged_batch(*MIXES["mixed"], 4, 2, head_dim, 16, dtype=dtype, device="cuda")
    assert_close(ops.ragged_attention(*batch.args()), reference(batch), dtype)


@pytest.mark.parametrize("window", [1, 3, 100, 600, 5000])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128),
                                            (torch.bfloat16, 256), (torch.float32, 64)])
def test_attention_window(dtype, head_dim, mix, window):
    """Sliding windows on the tensor-core kernels (splits over the windows' spans, merges of the
    splits a row's window reaches) and the simple kernel (256, float32)."""
    batch = random_ragged_batch(*MIXES[mix], 8, 2, head_dim, 16, dtype=dtype, device="cuda")
    out = ops.ragged_attention(*batch.args(), window)
    assert torch.isfinite(out).all()
    assert_close(out, reference(batch, window), dtype)


def test_attention_wide_block_table():
    """A block table much wider than the contexts (as when padded for CUDA graphs)."""
    batch = random_ragged_batch([1, 1, 7], [20, 300, 90], 8, 2, 64, 16, dtype=torch.bfloat16,
                                device="cuda")
    wide = torch.full((3, 512), 2 ** 30, dtype=torch.int32, device="cuda")  # junk past the end
    wide[:, :batch.block_table.shape[1]] = batch.block_table
    args = list(batch.args())
    args[5] = wide
    assert_close(ops.ragged_attention(*args), reference(batch), torch.bfloat16)


def test_attention_invalid_metadata_is_memory_safe():
    """Block ids out of range, contexts past the block table, offsets past T: no fault."""
    batch = random_ragged_batch([2, 1, 3], [10, 40, 3], 4, 2, 64, 4, dtype=torch.bfloat16,
                                device="cuda")
    args = list(batch.args())
    args[5] = batch.block_table.clone()
    args[5][1, 0] = 10 ** 6
    args[5][0, 1] = -3
    args[4] = torch.tensor([10, 10 ** 6, -5], dtype=torch.int32, device="cuda")
    args[3] = torch.tensor([0, 2, 100, 6], dtype=torch.int32, device="cuda")
    ops.ragged_attention(*args)
    torch.cuda.synchronize()  # an illegal address would surface here


def short_decode_batch(B, head_dim=64, heads=(8, 2), block_size=16, seed=0,
                       dtype=torch.bfloat16, max_ctx=600):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (B,), generator=gen).tolist()
    return random_ragged_batch([1] * B, ctx, *heads, head_dim, block_size, dtype=dtype,
                               device="cuda", seed=seed)


def test_attention_decode_batch_512_many_items_per_cta():
    """B = 512 decodes: more work items than CTAs, so each CTA loops over several; the
    per-request prefix is built by 128 threads over four requests each."""
    batch = short_decode_batch(512, head_dim=128)
    out = attend(batch)
    assert_close(out, device_reference(batch), torch.bfloat16)


def test_attention_prefill_4096_tokens():
    batch = random_ragged_batch([4096], [4096], 4, 2, 64, 16, dtype=torch.bfloat16,
                                device="cuda", seed=3)
    assert_close(attend(batch), device_reference(batch), torch.bfloat16)


@pytest.mark.parametrize("mix", ["decode", "prefill", "mixed", "long-decode", "long-prefill"])
@pytest.mark.parametrize("cap", [1, 2, 5])
def test_attention_capped_grid_is_bitwise_the_same(mix, cap):
    """A capped grid (attn_max_ctas) makes a few CTAs loop over every item: the same items run
    in another order on other CTAs, which must not change a bit (each item is computed by one
    CTA alone)."""
    batch = random_ragged_batch(*MIXES[mix], 8, 2, 64, 16, dtype=torch.bfloat16, device="cuda")
    free = attend(batch)
    with cuda_test_limits(attn_max_ctas=cap):
        assert torch.equal(attend(batch), free)
    assert_close(free, reference(batch), torch.bfloat16)


def test_attention_forced_split_no_split_and_capped_grid_agree():
    """Long contexts in a small batch split KV (partials + merge); attn_max_splits=1 runs them
    unsplit and attn_max_ctas=2 on two CTAs per KV head: all three match the reference, and
    the capped grid matches the split run bit for bit."""
    batch = random_ragged_batch([1, 1, 5, 1], [3000, 2100, 1500, 700], 8, 2, 128, 16,
                                dtype=torch.bfloat16, device="cuda", seed=5)
    expected = reference(batch)
    split = attend(batch)
    with cuda_test_limits(attn_max_splits=1):
        unsplit = attend(batch)
    with cuda_test_limits(attn_max_ctas=2):
        capped = attend(batch)
    for out in (split, unsplit, capped):
        assert_close(out, expected, torch.bfloat16)
    assert torch.equal(capped, split)
    assert not torch.equal(unsplit, split)  # different sums: the split path really ran


def test_attention_bad_test_cap_and_cpu_plan_are_errors():
    with pytest.raises(ValueError, match="attn_max_ctas and attn_max_splits must be "
                                         "non-negative"):
        orca_ext._C._set_cuda_test_limits(attn_max_ctas=-1)
    batch = random_ragged_batch([1], [10], 4, 2, 64, 16, dtype=torch.bfloat16)
    plan = ops.plan_attention(batch.q, batch.k_cache, batch.cu_q_lens, batch.context_lens,
                              batch.block_table)
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in batch.args()]
    with pytest.raises(RuntimeError, match="on CUDA the op plans from shapes alone"):
        ops.ragged_attention(*args, plan=plan)


@pytest.mark.parametrize("mix", ["decode", "mixed", "long-decode", "long-prefill"])
def test_attention_repeats_bit_for_bit(mix):
    """No atomics anywhere: repeated calls give identical bits (a difference would be a race)."""
    batch = random_ragged_batch(*MIXES[mix], 8, 2, 128, 16, dtype=torch.bfloat16, device="cuda")
    first = attend(batch)
    for _ in range(5):
        assert torch.equal(attend(batch), first)


@pytest.mark.parametrize("B", [8192, 8193])
def test_attention_batch_at_the_kernel_limit(B):
    """8192 requests: the largest batch whose prefix fits the tensor-core kernel's shared
    memory; 8193 runs the simple kernel instead. Both must be right."""
    batch = short_decode_batch(B, heads=(4, 1), max_ctx=40, seed=B)
    assert_close(attend(batch), decode_reference(batch), torch.bfloat16)


def test_kv_cache_past_2_31_elements():
    """A cache of more than 2^31 elements (4.3 GB each for K and V): offsets are 64-bit. Only
    the top blocks are used; the results equal those on a compact copy bit for bit."""
    small = random_ragged_batch([1, 7, 1], [300, 90, 1200], 8, 8, 128, 16,
                                dtype=torch.bfloat16, device="cuda", seed=11)
    per_block = 16 * 8 * 128
    num_blocks = (1 << 31) // per_block + 64
    base = num_blocks - small.k_cache.shape[0]
    big_k = torch.empty(num_blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    big_v = torch.empty_like(big_k)
    try:
        assert big_k.numel() > 1 << 31
        big_k[base:] = small.k_cache
        big_v[base:] = small.v_cache
        table = small.block_table + base
        out = attend(small, k_cache=big_k, v_cache=big_v, block_table=table)
        assert torch.equal(out, attend(small))
        assert_close(out, reference(small), torch.bfloat16)
        # store_kv into the top slots.
        key = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.tensor([num_blocks * 16 - 1, base * 16, (num_blocks - 2) * 16 + 5],
                             device="cuda")
        ops.store_kv(key, key * 2, big_k, big_v, slots)
        torch.cuda.synchronize()
        flat_k, flat_v = big_k.view(-1, 8, 128), big_v.view(-1, 8, 128)
        assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], key * 2)
    finally:
        del big_k, big_v
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- store_kv

def test_store_kv_out_of_range_slots_skipped():
    k_cache = torch.zeros(2, 4, 2, 8, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 8, device="cuda", dtype=torch.bfloat16)
    ops.store_kv(key, key, k_cache, v_cache, torch.tensor([1, 8, 10 ** 9], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(8, 2, 8)[1], key[0])
    assert k_cache.view(8, 2, 8)[[0, 2, 3, 4, 5, 6, 7]].abs().sum() == 0


# ---------------------------------------------------------------------------- packed_linear

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
@pytest.mark.parametrize("T", [1, 3, 8, 9, 64])       # skinny kernel up to 8, cuBLASLt above
@pytest.mark.parametrize("K", [256, 100])              # 100: not a multiple of 8 -> cuBLASLt
def test_packed_linear_paths(dtype, activation, T, K):
    gen = torch.Generator().manual_seed(T + K)
    N = 192
    x = torch.randn(T + 1, K, generator=gen).to(dtype).cuda()[1:]  # offset view
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).cuda()
    b = torch.randn(N, generator=gen).to(dtype).cuda()
    for bias in (None, b):
        out = ops.packed_linear(x, w, bias, activation)
        expected = ref.packed_linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu(),
                                     activation)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_packed_linear_without_cublaslt_epilogue(dtype, activation):
    """linear_no_epilogue forces the path taken when cuBLASLt has no algorithm for an
    epilogue: a plain GEMM, then the elementwise bias + activation kernel."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=gen).to(dtype).cuda()
    w = (torch.randn(192, 256, generator=gen) / 16).to(dtype).cuda()
    b = torch.randn(192, generator=gen).to(dtype).cuda()
    for bias in (None, b):
        with cuda_test_limits(linear_no_epilogue=True):
            out = ops.packed_linear(x, w, bias, activation)
        expected = ref.packed_linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu(),
                                     activation)
        assert_close(out, expected, dtype)


def test_launches_from_several_host_threads():
    """Four host threads, each on its own stream, run attention of different batch sizes (so
    different shared-memory sizes) and linears at once: every result equals the one-thread
    result bit for bit."""
    batches = [short_decode_batch(B, seed=B) for B in (3, 40, 700, 2000)]
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(384, 512, generator=gen) / 20).to(torch.bfloat16).cuda()
    xs = [torch.randn(T, 512, generator=gen).to(torch.bfloat16).cuda() for T in (1, 5, 24, 300)]
    expected = [(attend(b), ops.packed_linear(x, w, None, "gelu_tanh"))
                for b, x in zip(batches, xs)]
    torch.cuda.synchronize()
    results, errors = [None] * 4, []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                outs = [(ops.ragged_attention(*batches[i].args()),
                         ops.packed_linear(xs[i], w, None, "gelu_tanh")) for _ in range(20)]
            stream.synchronize()
            results[i] = outs
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for outs, (attn, lin) in zip(results, expected):
        for a, b in outs:
            assert torch.equal(a, attn)
            torch.testing.assert_close(b, lin)


# ---------------------------------------------------------------------------- opcheck

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_cuda(dtype):
    for q_lens, ctx in [([3, 1], [3, 20]), ([1, 1], [2000, 700])]:
        batch = random_ragged_batch(q_lens, ctx, 8, 2, 64, 16, dtype=dtype, device="cuda")
        torch.library.opcheck(torch.ops.orca.ragged_attention.default, batch.args())
    for T in (2, 40):
        x = torch.randn(T, 64, device="cuda", dtype=dtype)
        for act, n in [("none", 32), ("gelu_tanh", 32), ("relu", 32), ("silu_and_mul", 64),
                       ("gelu_tanh_and_mul", 64)]:
            torch.library.opcheck(torch.ops.orca.packed_linear.default,
                                  (x, torch.randn(n, 64, device="cuda", dtype=dtype),
                                   torch.randn(n, device="cuda", dtype=dtype), act))
    k_cache = torch.zeros(4, 4, 2, 64, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.orca.store_kv.default,
                          (torch.randn(3, 2, 64, device="cuda", dtype=dtype),
                           torch.randn(3, 2, 64, device="cuda", dtype=dtype), k_cache,
                           k_cache.clone(), torch.tensor([0, 5, -1], device="cuda")))


# ---------------------------------------------------------------------------- CUDA graphs

class DecodeStep:
    """One attention layer's decode step on static tensors: qkv = x @ Wqkv^T, store K/V,
    attend. Metadata lives in device tensors that are updated in place between replays."""

    def __init__(self, B, ctx0, hidden=256, Hq=8, Hkv=2, D=64, block_size=16, max_blocks=64,
                 dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(B)
        self.B, self.Hq, self.Hkv, self.D, self.bs = B, Hq, Hkv, D, block_size
        self.ctx = list(ctx0)
        num_blocks = B * max_blocks + 4
        perm = torch.randperm(num_blocks, generator=g)[:B * max_blocks]
        self.table = perm.view(B, max_blocks).to(torch.int32).cuda()
        self.w = (torch.randn((Hq + 2 * Hkv) * D, hidden, generator=g) / hidden ** 0.5).to(
            dtype).cuda()
        self.k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype).cuda()
        self.v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype).cuda()
        self.x = torch.empty(B, hidden, dtype=dtype, device="cuda")
        self.slots = torch.empty(B, dtype=torch.int64, device="cuda")
        self.context_lens = torch.empty(B, dtype=torch.int32, device="cuda")
        self.cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        self.gen = g

    def set_inputs(self):
        """Next decode step: a new token per request, contexts grow by one."""
        self.ctx = [c + 1 for c in self.ctx]
        table = self.table.cpu()
        slots = [int(table[r, (c - 1) // self.bs]) * self.bs + (c - 1) % self.bs
                 for r, c in enumerate(self.ctx)]
        self.x.copy_(torch.randn(self.x.shape, generator=self.gen).to(self.x.dtype))
        self.slots.copy_(torch.tensor(slots))
        self.context_lens.copy_(torch.tensor(self.ctx, dtype=torch.int32))

    def run(self, k_cache, v_cache):
        qkv = ops.packed_linear(self.x, self.w, None, "none")
        q, k, v = qkv.view(self.B, self.Hq + 2 * self.Hkv, self.D).split(
            [self.Hq, self.Hkv, self.Hkv], dim=1)
        ops.store_kv(k, v, k_cache, v_cache, self.slots)
        return ops.ragged_attention(q, k_cache, v_cache, self.cu, self.context_lens, self.table,
                                    self.D ** -0.5)


@pytest.mark.parametrize("B", [4, 24])  # skinny linear path / cuBLASLt path
def test_decode_step_cuda_graph_matches_eager(B):
    step = DecodeStep(B, ctx0=[37, 300, 5, 700] * (B // 4))
    k_eager, v_eager = step.k_cache.clone(), step.v_cache.clone()
    step.set_inputs()
    # Warm up on a side stream (cuBLASLt handles, algorithm cache), then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run(step.k_cache, step.v_cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step.run(step.k_cache, step.v_cache)
    for i in range(3):
        if i:
            step.set_inputs()
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")  # eager ops must not synchronize either
        try:
            eager = step.run(k_eager, v_eager)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        # Same kernels on the same inputs (cuBLASLt may reduce in another order: bf16 tolerance).
        torch.testing.assert_close(static_out, eager)
        torch.testing.assert_close(step.k_cache, k_eager)
        torch.testing.assert_close(step.v_cache, v_eager)


# ---------------------------------------------------------------------------- the runner

class RecordingSampler:
    """The runner's sampler, keeping a copy of every iteration's logits."""

    def __init__(self, sampler):
        self.sampler, self.logits = sampler, []

    def drop(self, request_ids):
        self.sampler.drop(request_ids)

    def __call__(self, logits, requests, *args, **kwargs):
        self.logits.append(logits.clone())
        return self.sampler(logits, requests, *args, **kwargs)


# Decode iterations as the requests running in them: batch sizes 1, 2, 3, 5, 8, 9, 16, 17 and
# 30 (buckets 1, 2, 4, 8, 8, 16, 16, 32, 32), requests joining and leaving in between.
DECODE_STEPS = [[0], [0, 1], [0, 1, 2], list(range(5)), list(range(8)), list(range(9)),
                list(range(3, 19)), list(range(17)), list(range(30)), [4, 29, 7], [29]]


def drive_runner(dtype, cuda_graphs, max_context=None, kv_dtype=None):
    """A prefill of 30 prompts, then DECODE_STEPS; returns the runner and its logits (the KV
    cache in ``kv_dtype``, default the activations' dtype)."""
    loaded = load_model("orca-tiny", dtype, "cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 60, (30,), generator=gen)]
    block_size = 16
    steps = len(DECODE_STEPS)
    blocks = sum(-(-(len(p) + steps) // block_size) for p in prompts)
    kv_cache = KVCache(loaded.config, blocks, block_size, kv_dtype or dtype, "cuda")
    runner = ModelRunner(loaded.model, kv_cache,
                         cuda_graphs=cuda_graphs, cuda_graph_max_context=max_context)
    runner.sampler = RecordingSampler(runner.sampler)
    allocator = SlotAllocator(blocks, block_size)
    batches = ScriptedBatches(allocator)
    params = SamplingParams(temperature=0.0)
    done = {}
    for r, prompt in enumerate(prompts):
        allocator.allocate(r, len(prompt) + steps)
        done[r] = len(prompt)
    runner.execute(batches.batch([(r, p, 0, params, len(p), True)
                                  for r, p in enumerate(prompts)]))
    for i, running in enumerate(DECODE_STEPS):
        rows = []
        for r in running:
            rows.append((r, [(7 * r + 3 * i) % 256], done[r], params, len(prompts[r]), True))
            done[r] += 1
        runner.execute(batches.batch(rows))
    return runner, allocator, runner.sampler.logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_decode_graphs_match_eager(dtype):
    """Every decode iteration replays its bucket's graph (batches padded to the bucket) and gives
    the eager runner's logits, across iterations that change the batch."""
    eager_runner, _, eager = drive_runner(dtype, cuda_graphs=False)
    graph_runner, _, graphed = drive_runner(dtype, cuda_graphs=True)
    assert eager_runner.graphs is None
    assert graph_runner.graphs.replays == len(DECODE_STEPS)
    assert sorted(graph_runner.graphs.graphs) == [1, 2, 4, 8, 16, 32]
    assert len(graphed) == len(eager) == len(DECODE_STEPS) + 1
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(graphed[0], eager[0], atol=0, rtol=0)  # the prefill: eager
    for got, want in zip(graphed[1:], eager[1:]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_runner_decode_graph_replays_bit_for_bit():
    """The same decode iteration replayed twice (same KV slot, same values) gives the same
    bits."""
    runner, allocator, _ = drive_runner(torch.bfloat16, cuda_graphs=True)
    blocks = [allocator.blocks(r) for r in (0, 1, 2)]
    table = torch.zeros(3, max(map(len, blocks)), dtype=torch.int32)
    for r, ids in enumerate(blocks):
        table[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    ctx = torch.tensor([len(ids) * 16 // 2 for ids in blocks], dtype=torch.int32)
    last = ctx.long() - 1  # each request's new token sits at its last position
    slots = table.long().gather(1, (last // 16)[:, None])[:, 0] * 16 + last % 16
    tokens = torch.tensor([5, 6, 7])
    first = runner.graphs.run(4, tokens, last, slots, ctx, table).clone()
    again = runner.graphs.run(4, tokens, last, slots, ctx, table)
    assert torch.equal(first, again)


def test_runner_runs_long_contexts_eagerly():
    """Contexts past the graphs' longest run eagerly, and give the same results."""
    runner, _, logits = drive_runner(torch.float32, cuda_graphs=True, max_context=32)
    _, _, eager = drive_runner(torch.float32, cuda_graphs=False)
    assert runner.graphs.replays < len(DECODE_STEPS)
    for got, want in zip(logits, eager):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)



# ---------------------------------------------------------------------------- the fp8 KV cache

FP8 = torch.float8_e4m3fn


def as_fp8_cache(batch):
    """The batch with its K/V rounded into fp8 caches, and the same batch reading them widened
    back to q's dtype (exact: every e4m3 value is a half, a bfloat16 and a float)."""
    k8, v8 = batch.k_cache.to(FP8), batch.v_cache.to(FP8)
    widened = dataclasses.replace(batch, k_cache=k8.to(batch.q.dtype), v_cache=v8.to(batch.q.dtype))
    return dataclasses.replace(batch, k_cache=k8, v_cache=v8), widened


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_fp8_rounds_as_torch_casts(dtype):
    """Stored bytes equal torch's round-to-nearest-even cast, out-of-range values saturate at
    +-448, a negative slot is skipped, strided K/V views are read as such."""
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(5, 3, 2, 64, generator=gen) * 8).to(dtype).cuda()
    qkv[0, 1, 0, :4] = torch.tensor([1000.0, -3e4, 448.0, 460.0], dtype=dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # strided views, like a fused QKV projection's
    k_cache = torch.zeros(2, 4, 2, 64, dtype=FP8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([6, 0, -1, 3, 7], device="cuda")
    ops.store_kv(key, value, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    for cache, src in ((k_cache, key), (v_cache, value)):
        rows = cache.view(8, 2, 64)
        want = src.float().clamp(-448, 448).to(FP8)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(rows[slot].view(torch.uint8), want[t].view(torch.uint8))
        assert rows[[1, 2, 4, 5]].view(torch.uint8).eq(0).all()
    assert k_cache.view(8, 2, 64)[6, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 40])  # 40: no tensor-core kernel
@pytest.mark.parametrize("mix", list(MIXES))
def test_attention_fp8_cache_against_the_widened_cache(dtype, head_dim, mix):
    """Every kernel (tensor-core decode / prefill tiles, split + merge, the simple kernel) on an
    fp8 cache gives the float64 attention over that cache's values."""
    q_lens, ctx = MIXES[mix]
    batch = random_ragged_batch(q_lens, ctx, 8, 2, head_dim, 16, dtype=dtype, device="cuda",
                                seed=head_dim + 1)
    fp8_batch, widened = as_fp8_cache(batch)
    out = ops.ragged_attention(*fp8_batch.args())
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_close(out, reference(widened), dtype)


@pytest.mark.parametrize("window", [3, 600])
def test_attention_fp8_cache_window_and_capped_grid(window):
    batch = random_ragged_batch(*MIXES["long-prefill"], 8, 2, 64, 16, dtype=torch.bfloat16,
                                device="cuda", seed=3)
    fp8_batch, widened = as_fp8_cache(batch)
    want = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in widened.args()),
                                window)
    got = ops.ragged_attention(*fp8_batch.args(), window)
    assert_close(got, want, torch.bfloat16)
    with cuda_test_limits(attn_max_ctas=2):
        assert torch.equal(ops.ragged_attention(*fp8_batch.args(), window), got)


def test_fp8_cache_errors_name_the_problem():
    batch = random_ragged_batch([1, 2], [5, 9], 4, 2, 64, 16, dtype=torch.bfloat16, device="cuda")
    fp8_batch, _ = as_fp8_cache(batch)
    with pytest.raises(RuntimeError, match="v_cache has dtype BFloat16 but k_cache has dtype "
                                           "Float8_e4m3fn"):
        ops.ragged_attention(batch.q, fp8_batch.k_cache, batch.v_cache, *batch.args()[3:])
    with pytest.raises(RuntimeError, match="fp8_e4m3 KV cache, which runs on CUDA only"):
        ops.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in fp8_batch.args()))
    # The fake kernels only: opcheck's other tests compare float8 tensors with torch.allclose,
    # which has no float8 kernel.
    fake_only = ("test_faketensor",)
    torch.library.opcheck(torch.ops.orca.ragged_attention.default, fp8_batch.args(),
                          test_utils=fake_only)
    key = torch.randn(2, 2, 64, device="cuda")
    torch.library.opcheck(torch.ops.orca.store_kv.default,
                          (key, key, fp8_batch.k_cache.clone(), fp8_batch.v_cache.clone(),
                           torch.tensor([0, 5], device="cuda")), test_utils=fake_only)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_on_an_fp8_cache(dtype):
    """The runner's prefill and decode iterations on an fp8 cache stay close to the same runner
    on a cache in the activations' dtype, and its decode CUDA graphs give its eager logits."""
    _, _, eager = drive_runner(dtype, cuda_graphs=False, kv_dtype=FP8)
    _, _, graphed = drive_runner(dtype, cuda_graphs=True, kv_dtype=FP8)
    _, _, full = drive_runner(dtype, cuda_graphs=False)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for got, want in zip(graphed[1:], eager[1:]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for got, want in zip(eager, full):
        relative = (got.double() - want.double()).norm() / want.double().norm()
        assert relative < 0.1, relative


def test_engine_fp8_kv_holds_twice_the_tokens():
    config = dict(dtype="bfloat16", device="cuda", kv_cache_memory=2**20, max_batch_size=4)
    fp8 = LLM("orca-tiny", kv_cache_dtype="fp8", **config)
    auto = LLM("orca-tiny", **config)
    assert fp8.engine.executor.kv_cache.dtype == FP8
    assert fp8.engine.executor.kv_cache.num_blocks // 2 == auto.engine.executor.kv_cache.num_blocks
    params = orca_ext.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello, my name is", "The capital of France is", "a" * 40, "x"]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in auto.generate(prompts, params, use_tqdm=False)]
    assert all(len(ids) == 12 for ids in got)
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    assert same >= 0.75 * 12 * len(prompts), (got, want)
