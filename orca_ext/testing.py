"""Random ragged paged batches and kernel-path overrides, for tests and benchmarks of the ops."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import _C


@contextmanager
def forced_isa(kind: str, name: str) -> Iterator[None]:
    """Run the kernels of ``kind`` ('quant', 'attention', 'lora') on path ``name`` inside the
    block, then go back to the process's default path."""
    _C.set_isa(kind, name)
    try:
        yield
    finally:
        _C.set_isa(kind, "")


@contextmanager
def cuda_test_limits(attn_max_ctas: int = 0, attn_max_splits: int = 0,
                     linear_no_epilogue: bool = False) -> Iterator[None]:
    """Inside the block, cap the CUDA attention's tensor-core grid (CTAs per KV head) and KV
    splits (0: no cap), and run packed_linear without cuBLASLt's epilogue: paths a small test
    on a large GPU would not take otherwise."""
    _C._set_cuda_test_limits(attn_max_ctas, attn_max_splits, linear_no_epilogue)
    try:
        yield
    finally:
        _C._set_cuda_test_limits()


@dataclass
class RaggedBatch:
    q: torch.Tensor             # [T, Hq, D]
    k_cache: torch.Tensor       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    cu_q_lens: torch.Tensor     # int32 [B+1]
    context_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor   # int32 [B, max_blocks]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.cu_q_lens, self.context_lens,
                self.block_table, self.scale)


def random_ragged_batch(q_lens: list[int], context_lens: list[int], num_q_heads: int,
                        num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype = torch.float32, device: str = "cpu",
                        seed: int = 0) -> RaggedBatch:
    """Requests with ``q_lens[r]`` new tokens over ``context_lens[r]`` KV positions, their
    blocks scattered over a shuffled pool with a few spare blocks."""
    assert len(q_lens) == len(context_lens)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_req + [1])
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[used:used + n]
        used += n
    T = sum(q_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return RaggedBatch(
        q=rand(T, num_q_heads, head_dim).to(device),
        k_cache=rand(num_blocks, block_size, num_kv_heads, head_dim).to(device),
        v_cache=rand(num_blocks, block_size, num_kv_heads, head_dim).to(device),
        cu_q_lens=cu.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
        block_table=block_table.to(device),
        scale=head_dim ** -0.5,
    )
