"""Op benchmarks: orca ops against torch baselines measured in the same run.

    python bench/ops.py [--device cpu|cuda] [--seed 0] [--attention-dtype float32|bfloat16]

CPU figures (targets on a 2-core machine): packed_linear >= 0.95x F.linear, faster than
F.linear + a separate activation; ragged_attention >= 2x a per-request SDPA loop and >= 1.5x
one padded SDPA call on Orca-like mixed batches; one causal prefill >= torch's own CPU flash
attention (F.scaled_dot_product_attention(is_causal=True) on contiguous tensors), float32 and
bfloat16 (each kernel path ORCA_ATTENTION_ISA can pick). On CUDA the figures of
bench/ops_cuda.py run.

    python bench/ops.py --only flash    # just the prefill-against-flash-attention rows
"""
from __future__ import annotations

import argparse
import contextlib
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import row, time_fn  # noqa: E402

from orca_ext import _C, ops  # noqa: E402
from orca_ext.testing import RaggedBatch, forced_isa, random_ragged_batch  # noqa: E402


def bench_linear(device: str) -> None:
    print("== packed_linear (GPT-2-small shapes, float32) ==")
    # Up to 8 tokens the skinny kernel, 9-32 the token-lanes kernel, above oneDNN (float32).
    for T in (1, 4, 8, 32, 300, 544):
        for K, N, act in [(768, 2304, "none"), (768, 3072, "gelu_tanh"), (768, 2 * 2048, "silu_and_mul")]:
            x = torch.randn(T, K, device=device)
            w = torch.randn(N, K, device=device) / K ** 0.5
            b = torch.randn(N, device=device) if act != "silu_and_mul" else None
            ours = time_fn(lambda: ops.packed_linear(x, w, b, act), device)
            if act == "none":
                base = time_fn(lambda: F.linear(x, w, b), device)
                print(row(f"T={T} {K}->{N} bias", ours, base, "F.linear"))
                continue
            eager = {
                "gelu_tanh": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                "silu_and_mul": lambda: (lambda y: F.silu(y[:, :N // 2]) * y[:, N // 2:])(F.linear(x, w)),
            }[act]
            base = time_fn(eager, device)
            print(row(f"T={T} {K}->{N} {act}", ours, base, "linear+act"))


def orca_batch(num_decode: int, num_prefill: int, rng: random.Random, device: str,
               dtype: torch.dtype) -> RaggedBatch:
    """Orca-like mix: decodes with contexts ~U[32,640] and prefills of ~U[32,512] tokens."""
    q_lens, ctx = [], []
    for _ in range(num_prefill):
        n = rng.randint(32, 512)
        q_lens.append(n)
        ctx.append(n)
    for _ in range(num_decode):
        q_lens.append(1)
        ctx.append(rng.randint(32, 640))
    return random_ragged_batch(q_lens, ctx, 12, 12, 64, 16, dtype=dtype, device=device,
                               seed=rng.randint(0, 99))


def per_request_sdpa(batch: RaggedBatch, slots: list[torch.Tensor]):
    """Baseline (a): one SDPA call per request on its gathered KV."""
    cu = batch.cu_q_lens.tolist()
    flat_k = batch.k_cache.flatten(0, 1)
    flat_v = batch.v_cache.flatten(0, 1)
    out = torch.empty_like(batch.q)

    def run():
        for r, s in enumerate(slots):
            q = batch.q[cu[r]:cu[r + 1]].transpose(0, 1)
            k, v = flat_k[s].transpose(0, 1), flat_v[s].transpose(0, 1)
            q_len, ctx = q.shape[1], k.shape[1]
            mask = None if q_len == 1 else (
                torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len))
            out[cu[r]:cu[r + 1]] = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=batch.scale).transpose(0, 1)
        return out
    return run


def padded_sdpa(batch: RaggedBatch, slots: list[torch.Tensor]):
    """Baseline (b): pad every request to the longest query and context, one SDPA call."""
    cu = batch.cu_q_lens.tolist()
    q_lens = [cu[r + 1] - cu[r] for r in range(len(slots))]
    ctx = [len(s) for s in slots]
    B, max_q, max_ctx = len(slots), max(q_lens), max(ctx)
    device = batch.q.device
    pad_slots = torch.zeros(B, max_ctx, dtype=torch.long, device=device)
    mask = torch.zeros(B, 1, max_q, max_ctx, dtype=torch.bool, device=device)
    q_index = torch.zeros(B, max_q, dtype=torch.long, device=device)
    valid = torch.zeros(B, max_q, dtype=torch.bool, device=device)
    for r, s in enumerate(slots):
        pad_slots[r, :ctx[r]] = s
        q_pos = torch.arange(ctx[r] - q_lens[r], ctx[r], device=device)
        mask[r, 0, :q_lens[r], :ctx[r]] = torch.arange(ctx[r], device=device)[None] <= q_pos[:, None]
        mask[r, 0, q_lens[r]:, 0] = True  # padding rows attend somewhere, then are dropped
        q_index[r, :q_lens[r]] = torch.arange(cu[r], cu[r + 1], device=device)
        valid[r, :q_lens[r]] = True
    flat_k = batch.k_cache.flatten(0, 1)
    flat_v = batch.v_cache.flatten(0, 1)

    def run():
        q = batch.q[q_index].transpose(1, 2)              # [B, H, max_q, D]
        k = flat_k[pad_slots].transpose(1, 2)
        v = flat_v[pad_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        return o.transpose(1, 2)[valid]
    return run


def request_slots(batch: RaggedBatch) -> list[torch.Tensor]:
    bs = batch.k_cache.shape[1]
    out = []
    for r, c in enumerate(batch.context_lens.tolist()):
        pos = torch.arange(c, device=batch.q.device)
        out.append(batch.block_table[r].long()[pos // bs] * bs + pos % bs)
    return out


def bench_attention(device: str, seed: int, dtype: torch.dtype) -> None:
    print(f"== ragged_attention (12 heads x 64, block_size 16, {str(dtype).split('.')[1]}) ==")
    rng = random.Random(seed)
    cases = [(f"32 decodes + {p} prefills", orca_batch(32, p, rng, device, dtype))
             for p in (0, 1, 2)]
    cases.append(("1 long decode, context 8192",
                  random_ragged_batch([1], [8192], 12, 12, 64, 16, dtype=dtype, device=device)))
    cases.append(("1 long prefill, 2048 tokens",
                  random_ragged_batch([2048], [2048], 12, 12, 64, 16, dtype=dtype,
                                      device=device)))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, batch in cases:
        slots = request_slots(batch)
        ours_fn = lambda: ops.ragged_attention(*batch.args())  # noqa: E731
        loop_fn, pad_fn = per_request_sdpa(batch, slots), padded_sdpa(batch, slots)
        torch.testing.assert_close(ours_fn(), loop_fn().clone(), atol=tol, rtol=tol)
        ours = time_fn(ours_fn, device)
        print(row(name, ours, time_fn(loop_fn, device), "SDPA loop"))
        if len(slots) > 1:
            print(row(name, ours, time_fn(pad_fn, device), "padded SDPA"))


def bench_flash(device: str) -> None:
    """One causal prefill of T tokens (12 heads x 64, block_size 16) against torch's CPU flash
    attention on contiguous [1, 12, T, 64] tensors; bfloat16 on each of our kernel paths."""
    print("== prefill ragged_attention against F.scaled_dot_product_attention(is_causal=True) ==")
    paths = {torch.float32: [None], torch.bfloat16: _C.attention_isas()[::-1]}
    for dtype, isas in paths.items():
        for T in (128, 512, 2048):
            batch = random_ragged_batch([T], [T], 12, 12, 64, 16, dtype=dtype, device=device)
            q, k, v = (torch.randn(1, 12, T, 64, dtype=dtype, device=device) for _ in range(3))
            flash = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            device)
            flops = 2 * 2 * T * T * 64 * 12 / 2  # Q.K and P.V over the causal half
            for isa in isas:
                with forced_isa("attention", isa) if isa else contextlib.nullcontext():
                    ours = time_fn(lambda: ops.ragged_attention(*batch.args()), device)
                name = f"{str(dtype).split('.')[1]} T={T}" + (f" [{isa}]" if isa else "")
                print(row(name, ours, flash, "flash") +
                      f"   {flops / ours / 1e9:4.0f} / {flops / flash / 1e9:4.0f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the ragged_attention cases (bfloat16: on CPUs with "
                        "AVX512-BF16 the prefill rows run the bf16 pair kernels)")
    parser.add_argument("--only", choices=["linear", "attention", "flash"],
                        help="run one section (default: all)")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        import ops_cuda
        ops_cuda.main()
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "linear"):
        bench_linear(args.device)
    if args.only in (None, "attention"):
        bench_attention(args.device, args.seed, getattr(torch, args.attention_dtype))
    if args.only in (None, "flash"):
        bench_flash(args.device)


if __name__ == "__main__":
    main()
