"""CUDA op benchmarks: each orca figure against a baseline measured in the same run.

    python bench/ops_cuda.py [--out results.json] [--quick]

Figures and targets (bf16, head_dim 128, block_size 16):
  decode_bw_long    ragged decode attention bytes/s (K+V read) / device-to-device copy bytes/s
                    (read + write), KV >= 128 MB                                      >= 0.70
  decode_bw_short   the same with contexts ~250 tokens                                 >= 0.50
  fp8_decode        decode_bw_long's batch: time on the bf16 cache / time on an fp8 e4m3
                    cache (half the bytes)                                             >= 1.30
  split_balance     time(1 x 32K context) / time(16 x 2K contexts), equal KV           <= 1.30
  mixed_vs_padded   padded torch SDPA time / ours on an Orca-like mixed batch         >= 1.5
  prefill_vs_flash  our prefill TFLOP/s / torch SDPA flash backend TFLOP/s            >= 0.70
  linear_vs_matmul  torch.matmul time / packed_linear time (no bias), each T          >= 0.95
  gelu_vs_eager     F.gelu(F.linear(x, w, b)) time / packed_linear(.., "gelu_tanh")
                    time, T <= 256                                                    >= 1.15
Times are CUDA-event medians of back-to-back calls (launch overhead included for both sides).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys

import torch
import torch.nn.functional as F

from orca_ext import ops
from orca_ext.testing import RaggedBatch

DTYPE = torch.bfloat16
DEVICE = "cuda"
HQ, HKV, D, BS = 32, 8, 128, 16


def cuda_time(fn, min_ms: float = 40.0, reps: int = 5) -> float:
    """Median seconds per call, timed with CUDA events over back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, min(2000, int(min_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n / 1e3)
    return statistics.median(times)


def paged_batch(q_lens: list[int], ctx: list[int], hq: int = HQ, hkv: int = HKV, d: int = D,
                block_size: int = BS, seed: int = 0) -> RaggedBatch:
    """A batch whose KV blocks are scattered over a shuffled pool, built on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks = [-(-c // block_size) for c in ctx]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g).to(torch.int32)
    table = torch.zeros(len(ctx), max(blocks + [1]), dtype=torch.int32, device=DEVICE)
    used = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[used:used + n]
        used += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    shape = (num_blocks, block_size, hkv, d)
    return RaggedBatch(
        q=torch.randn(sum(q_lens), hq, d, device=DEVICE, dtype=DTYPE, generator=g),
        k_cache=torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=g),
        v_cache=torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=g),
        cu_q_lens=cu.to(DEVICE), context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
        block_table=table, scale=d ** -0.5)


def kv_bytes(batch: RaggedBatch) -> int:
    per_pos = 2 * batch.k_cache.shape[2] * batch.k_cache.shape[3] * batch.k_cache.element_size()
    return int(batch.context_lens.sum().item()) * per_pos


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    return 2 * nbytes / t  # read + write


def attention(batch: RaggedBatch):
    return lambda: ops.ragged_attention(*batch.args())


class Report:
    def __init__(self):
        self.rows = []

    def add(self, name: str, value: float, target: str, detail: str):
        op, bound = target.split()
        ok = value >= float(bound) if op == ">=" else value <= float(bound)
        self.rows.append({"figure": name, "value": round(value, 4), "target": target,
                          "pass": ok, "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name:<34} {value:8.3f}  (target {target})  {detail}",
              flush=True)


def long_decode_contexts(quick: bool) -> list[int]:
    """decode_bw_long's requests: 4096 positions each."""
    return [4096] * (8 if quick else 32)


def bench_decode(rep: Report, copy_bw: float, quick: bool) -> None:
    rng = random.Random(0)
    cases = [("decode_bw_long", long_decode_contexts(quick), ">= 0.70"),
             ("decode_bw_short", [rng.randint(200, 300) for _ in range(256 if quick else 1024)],
              ">= 0.50")]
    for name, ctx, target in cases:
        batch = paged_batch([1] * len(ctx), ctx)
        t = cuda_time(attention(batch))
        bw = kv_bytes(batch) / t
        rep.add(name, bw / copy_bw, target,
                f"B={len(ctx)} KV={kv_bytes(batch) / 2**20:.0f} MiB {t * 1e6:.1f} us "
                f"{bw / 1e12:.2f} TB/s vs copy {copy_bw / 1e12:.2f} TB/s")


def bench_fp8_decode(rep: Report, quick: bool) -> None:
    """decode_bw_long's batch on its bfloat16 cache and on the same cache rounded to fp8."""
    ctx = long_decode_contexts(quick)
    batch = paged_batch([1] * len(ctx), ctx)
    fp8 = dataclasses.replace(batch, k_cache=batch.k_cache.to(torch.float8_e4m3fn),
                              v_cache=batch.v_cache.to(torch.float8_e4m3fn))
    t, t8 = cuda_time(attention(batch)), cuda_time(attention(fp8))
    rep.add("fp8_decode", t / t8, ">= 1.30",
            f"B={len(batch.context_lens)} bf16 {t * 1e6:.1f} us, fp8 {t8 * 1e6:.1f} us "
            f"({kv_bytes(fp8) / t8 / 1e12:.2f} TB/s of fp8 K+V)")


def bench_split_balance(rep: Report) -> None:
    one = paged_batch([1], [32768])
    many = paged_batch([1] * 16, [2048] * 16)
    t_one, t_many = cuda_time(attention(one)), cuda_time(attention(many))
    rep.add("split_balance", t_one / t_many, "<= 1.30",
            f"1x32K {t_one * 1e6:.1f} us, 16x2K {t_many * 1e6:.1f} us")


def padded_sdpa_inputs(batch: RaggedBatch):
    """Dense padded q/k/v [B, Hq, L, D] (GQA heads expanded) and the causal+padding mask."""
    cu = batch.cu_q_lens.tolist()
    ctx = batch.context_lens.tolist()
    bs = batch.k_cache.shape[1]
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    B, max_q, max_ctx = len(ctx), max(cu[r + 1] - cu[r] for r in range(len(ctx))), max(ctx)
    q = torch.zeros(B, batch.q.shape[1], max_q, batch.q.shape[2], dtype=DTYPE, device=DEVICE)
    k = torch.zeros(B, batch.q.shape[1], max_ctx, batch.q.shape[2], dtype=DTYPE, device=DEVICE)
    v = torch.zeros_like(k)
    mask = torch.zeros(B, 1, max_q, max_ctx, dtype=torch.bool, device=DEVICE)
    flat_k, flat_v = batch.k_cache.flatten(0, 1), batch.v_cache.flatten(0, 1)
    for r in range(B):
        n, c = cu[r + 1] - cu[r], ctx[r]
        pos = torch.arange(c, device=DEVICE)
        slots = batch.block_table[r].long()[pos // bs] * bs + pos % bs
        q[r, :, :n] = batch.q[cu[r]:cu[r + 1]].transpose(0, 1)
        k[r, :, :c] = flat_k[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        v[r, :, :c] = flat_v[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(c - n, c, device=DEVICE)
        mask[r, 0, :n, :c] = pos[None] <= q_pos[:, None]
        mask[r, 0, n:, 0] = True  # padding rows attend somewhere
    return q, k, v, mask


def bench_mixed(rep: Report) -> None:
    rng = random.Random(1)
    q_lens, ctx = [], []
    for _ in range(4):  # new prompts
        n = rng.randint(256, 512)
        q_lens.append(n)
        ctx.append(n)
    for _ in range(60):  # running requests
        q_lens.append(1)
        ctx.append(rng.randint(256, 2048))
    batch = paged_batch(q_lens, ctx)
    q, k, v, mask = padded_sdpa_inputs(batch)
    t_ours = cuda_time(attention(batch))
    t_pad = cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             scale=batch.scale))
    rep.add("mixed_vs_padded", t_pad / t_ours, ">= 1.5",
            f"4 prefills + 60 decodes: ours {t_ours * 1e6:.1f} us, padded SDPA (dense inputs "
            f"prebuilt, not timed) {t_pad * 1e6:.1f} us")


def bench_prefill(rep: Report) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    T, H = 4096, 32
    batch = paged_batch([T], [T], hq=H, hkv=H)
    flops = 4 * H * D * (T * (T + 1) / 2)
    t_ours = cuda_time(attention(batch))
    flat = lambda c: c.flatten(0, 1)  # noqa: E731
    table = batch.block_table[0].long()
    pos = torch.arange(T, device=DEVICE)
    slots = table[pos // BS] * BS + pos % BS
    q = batch.q.transpose(0, 1)[None].contiguous()
    k = flat(batch.k_cache)[slots].transpose(0, 1)[None].contiguous()
    v = flat(batch.v_cache)[slots].transpose(0, 1)[None].contiguous()

    def fn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=batch.scale)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_flash = cuda_time(fn)
        diff = fn()[0].transpose(0, 1).float() - attention(batch)().float()
        err = diff.abs().max().item()
    rep.add("prefill_vs_flash", t_flash / t_ours, ">= 0.70",
            f"T={T} H={H} D={D} causal: ours {flops / t_ours / 1e12:.0f} TFLOP/s, flash "
            f"{flops / t_flash / 1e12:.0f} TFLOP/s, max |diff| {err:.3g}")


def bench_linear(rep: Report, quick: bool) -> None:
    K = N = 4096
    w = torch.randn(N, K, device=DEVICE, dtype=DTYPE) / K ** 0.5
    b = torch.randn(N, device=DEVICE, dtype=DTYPE)
    ratios = []
    for T in (1, 4, 8, 16, 64, 512) + (() if quick else (4096,)):
        x = torch.randn(T, K, device=DEVICE, dtype=DTYPE)
        t_ours = cuda_time(lambda: ops.packed_linear(x, w, None, "none"))
        t_mm = cuda_time(lambda: torch.matmul(x, w.t()))
        ratios.append((t_mm / t_ours, T, t_ours, t_mm))
    worst = min(ratios)
    rep.add("linear_vs_matmul", worst[0], ">= 0.95",
            "worst over T; " + ", ".join(f"T={T}: {r:.2f} ({o * 1e6:.1f} vs {m * 1e6:.1f} us)"
                                         for r, T, o, m in ratios))
    ratios = []
    for T in (1, 16, 64, 256):
        x = torch.randn(T, K, device=DEVICE, dtype=DTYPE)
        t_ours = cuda_time(lambda: ops.packed_linear(x, w, b, "gelu_tanh"))
        t_eager = cuda_time(lambda: F.gelu(F.linear(x, w, b), approximate="tanh"))
        ratios.append((t_eager / t_ours, T, t_ours, t_eager))
    worst = min(ratios)
    rep.add("gelu_vs_eager", worst[0], ">= 1.15",
            "worst over T; " + ", ".join(f"T={T}: {r:.2f} ({o * 1e6:.1f} vs {e * 1e6:.1f} us)"
                                         for r, T, o, e in ratios))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--quick", action="store_true", help="smaller batches (smoke run)")
    args, _ = parser.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    torch.manual_seed(0)
    prop = torch.cuda.get_device_properties(0)
    print(f"{prop.name}, {prop.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    rep = Report()
    copy_bw = copy_bandwidth(512 << 20)
    sections = [("decode", lambda: bench_decode(rep, copy_bw, args.quick)),
                ("fp8_decode", lambda: bench_fp8_decode(rep, args.quick)),
                ("split_balance", lambda: bench_split_balance(rep)),
                ("mixed", lambda: bench_mixed(rep)), ("prefill", lambda: bench_prefill(rep)),
                ("linear", lambda: bench_linear(rep, args.quick))]
    for name, section in sections:
        try:
            section()
        except Exception as e:  # keep the other figures
            print(f"ERROR in {name}: {type(e).__name__}: {e}", flush=True)
            rep.rows.append({"figure": "error", "value": math.nan, "target": "",
                             "pass": False, "detail": f"{type(e).__name__}: {e}"})
        torch.cuda.empty_cache()
    result = {"device": prop.name, "torch": torch.__version__, "figures": rep.rows,
              "all_pass": all(r["pass"] for r in rep.rows)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"{sum(r['pass'] for r in rep.rows)}/{len(rep.rows)} figures meet their targets")
    return 0


if __name__ == "__main__":
    sys.exit(main())
