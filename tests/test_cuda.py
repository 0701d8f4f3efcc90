"""CUDA-only checks of the torch.ops.orca kernels (skipped without a GPU).

The device-parametrized reference tests are in test_ops.py; these add what only the CUDA path
has: the tensor-core attention kernels (bf16/fp16, every supported head dim, decode / prefill /
split-KV work partitions), the skinny and cuBLASLt linear paths, opcheck on CUDA, memory
safety with invalid metadata, and a decode step (packed_linear -> store_kv -> ragged_attention)
captured in a CUDA graph and replayed with new metadata, which would fail if an op read device
values on the host or synchronized.
"""
import pytest
import torch

import orca_ext
import reference_ops as ref
from orca_ext import ops
from orca_ext.testing import random_ragged_batch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and orca_ext.has_cuda()),
    reason="needs a GPU and a CUDA build of orca_ext")

TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


def reference(batch):
    return ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a for a in batch.args()))


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
@pytest.mark.parametrize("activation", ["none", "gelu_tanh", "relu", "silu_and_mul"])
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


# ---------------------------------------------------------------------------- opcheck

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_cuda(dtype):
    for q_lens, ctx in [([3, 1], [3, 20]), ([1, 1], [2000, 700])]:
        batch = random_ragged_batch(q_lens, ctx, 8, 2, 64, 16, dtype=dtype, device="cuda")
        torch.library.opcheck(torch.ops.orca.ragged_attention.default, batch.args())
    for T in (2, 40):
        x = torch.randn(T, 64, device="cuda", dtype=dtype)
        for act, n in [("none", 32), ("gelu_tanh", 32), ("relu", 32), ("silu_and_mul", 64)]:
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
