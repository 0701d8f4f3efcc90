"""One case per CUDA kernel path against the reference, each followed by a synchronize.

    python3 bench/cuda_smoke.py [--small] [--after CASE] [--model] [--list]

Prints ``OK <case>`` or ``FAIL <case> <error>`` (flushed) as each case ends, so that a fault -
which the synchronize after each case surfaces - names its case even when it kills the
process. An illegal address poisons the CUDA context and every later case would fail with the
same error: the script then prints ``ABORT <case>`` and exits 2; rerun with ``--after <case>``
(in a new process) for the rest. ``--small`` keeps the cases compute-sanitizer can afford;
``--model`` compares orca-tiny's logits on CUDA (CUDA graphs on) with the CPU's instead.
Exit status: 0 all OK, 1 some FAIL, 2 aborted. Run it outside the source tree so that the
installed build of orca_ext is imported (bench/gpu_check.sh does).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference_ops as ref  # noqa: E402

import orca_ext  # noqa: E402
from orca_ext import ops  # noqa: E402
from orca_ext.testing import random_ragged_batch  # noqa: E402

TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}
Case = Callable[[], None]
CASES: list[tuple[str, str, bool, Case]] = []  # (name, what it covers, small, run)


def case(name: str, what: str, small: bool = True) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES.append((name, what, small, fn))
        return fn
    return register


@contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.cuda.synchronize()
    tol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=tol,
                               rtol=tol)


def attention_case(q_lens, ctx, hq, hkv, d, block_size, dtype=torch.bfloat16, seed=0) -> None:
    batch = random_ragged_batch(q_lens, ctx, hq, hkv, d, block_size, dtype=dtype, device="cuda",
                                seed=seed)
    out = ops.ragged_attention(*batch.args())
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a
                                      for a in batch.args()))
    check(out, expected, dtype)


# ---- ragged_attention --------------------------------------------------------------------

@case("attn-tc-decode", "attention tc decode tiles bf16 D=128 GQA")
def _():
    attention_case([1] * 6, [1, 17, 64, 65, 130, 300], 8, 2, 128, 16)


@case("attn-tc-prefill", "attention tc prefill tiles fp16 D=64")
def _():
    attention_case([5, 64, 33, 1], [5, 64, 33, 1], 8, 2, 64, 16, torch.float16)


@case("attn-tc-split-merge", "attention tc split-KV + merge bf16")
def _():
    attention_case([1, 1, 1], [3000, 1100, 40], 8, 2, 128, 16)


@case("attn-tc-unsplit", "attention tc unsplit long decode (ORCA_ATTN_MAX_SPLITS=1)")
def _():
    with env("ORCA_ATTN_MAX_SPLITS", "1"):
        attention_case([1, 1], [2000, 700], 8, 2, 64, 16)


@case("attn-tc-chunked-prefill", "attention tc chunked prefill over cached KV, split")
def _():
    attention_case([300, 1], [1200, 2500], 8, 2, 64, 16)


@case("attn-tc-head-dims", "attention tc head dims 32 / 80 / 96, MQA, block sizes 1 / 5")
def _():
    attention_case([1, 40, 1, 9], [70, 40, 3, 30], 8, 1, 32, 5)
    attention_case([1, 1, 7], [65, 129, 20], 4, 2, 80, 1, torch.float16)
    attention_case([3, 1], [50, 300], 4, 4, 96, 16)


@case("attn-tc-capped-grid",
      "attention tc B=200, grid capped to 2 CTAs (prefix over >1 request per thread)")
def _():
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(1, 100, (200,), generator=gen).tolist()
    with env("ORCA_ATTN_MAX_CTAS", "2"):
        attention_case([1] * 200, ctx, 4, 1, 64, 16)


@case("attn-simple", "attention simple kernel fp32 and odd head dim")
def _():
    attention_case([1, 40, 1], [70, 40, 3], 4, 2, 64, 16, torch.float32)
    attention_case([3, 1], [20, 50], 4, 2, 40, 4)


@case("attn-padded-table", "attention block table padded far past the contexts")
def _():
    batch = random_ragged_batch([1, 1, 7], [20, 300, 90], 8, 2, 64, 16, dtype=torch.bfloat16,
                                device="cuda")
    wide = torch.full((3, 2048), 2 ** 30, dtype=torch.int32, device="cuda")
    wide[:, :batch.block_table.shape[1]] = batch.block_table
    args = list(batch.args())
    args[5] = wide
    expected = ref.ragged_attention(*(a.cpu() if torch.is_tensor(a) else a
                                      for a in batch.args()))
    check(ops.ragged_attention(*args), expected, torch.bfloat16)


@case("attn-invalid-metadata", "attention invalid metadata is memory-safe (values unchecked)")
def _():
    batch = random_ragged_batch([2, 1, 3], [10, 40, 3], 4, 2, 64, 4, dtype=torch.bfloat16,
                                device="cuda")
    args = list(batch.args())
    args[5] = batch.block_table.clone()
    args[5][1, 0] = 10 ** 6
    args[5][0, 1] = -3
    args[4] = torch.tensor([10, 10 ** 6, -5], dtype=torch.int32, device="cuda")
    args[3] = torch.tensor([0, 2, 100, 6], dtype=torch.int32, device="cuda")
    ops.ragged_attention(*args)
    torch.cuda.synchronize()


@case("attn-b8192", "attention B=8192 decode (the tensor-core kernel's largest batch)",
      small=False)
def _():
    gen = torch.Generator().manual_seed(2)
    ctx = torch.randint(1, 24, (8192,), generator=gen).tolist()
    attention_case([1] * 8192, ctx, 4, 1, 64, 16)


# ---- store_kv ----------------------------------------------------------------------------

@case("store-kv", "store_kv 16 / 8 / 4 / 2-byte vectors, skipped slots")
def _():
    for d in (64, 4, 2, 1):  # bf16 rows of 128, 8, 4, 2 bytes
        k_cache = torch.zeros(4, 4, 2, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(4, 2, d, device="cuda", dtype=torch.bfloat16)
        slots = torch.tensor([3, -1, 15, 10 ** 9], device="cuda")
        ops.store_kv(key, key * 2, k_cache, v_cache, slots)
        expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        flat_k, flat_v = expected_k.view(16, 2, d), expected_v.view(16, 2, d)
        flat_k[3], flat_v[3] = key[0], key[0] * 2
        flat_k[15], flat_v[15] = key[2], key[2] * 2
        torch.cuda.synchronize()
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), f"D={d}"


# ---- packed_linear -----------------------------------------------------------------------

def linear_case(T: int, K: int, activation: str, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 192
    x = torch.randn(T + 1, K, generator=gen).to(dtype).cuda()[1:]  # an offset view
    w = (torch.randn(n, K, generator=gen) / K ** 0.5).to(dtype).cuda()
    b = torch.randn(n, generator=gen).to(dtype).cuda()
    for bias in (None, b):
        out = ops.packed_linear(x, w, bias, activation)
        expected = ref.packed_linear(x.cpu(), w.cpu(), None if bias is None else bias.cpu(),
                                     activation)
        check(out, expected, dtype)


@case("linear-skinny", "packed_linear skinny kernel (T <= 8), every activation, bf16 + fp32")
def _():
    for act in ("none", "gelu_tanh", "relu", "silu_and_mul"):
        linear_case(3, 256, act, torch.bfloat16)
        linear_case(8, 128, act, torch.float32)


@case("linear-cublaslt", "packed_linear cuBLASLt with fused epilogues (T = 64), fp16 + bf16")
def _():
    for act in ("none", "gelu_tanh", "relu", "silu_and_mul"):
        linear_case(64, 256, act, torch.float16)
        linear_case(40, 256, act, torch.bfloat16)


@case("linear-no-epilogue",
      "packed_linear without the cuBLASLt epilogue (ORCA_LINEAR_NO_EPILOGUE=1)")
def _():
    with env("ORCA_LINEAR_NO_EPILOGUE", "1"):
        for act in ("none", "gelu_tanh", "relu", "silu_and_mul"):
            linear_case(64, 256, act, torch.bfloat16)


@case("linear-odd-k", "packed_linear K not a multiple of 8 (cuBLASLt at any T)")
def _():
    linear_case(3, 100, "gelu_tanh", torch.float16)
    linear_case(33, 100, "silu_and_mul", torch.bfloat16)


@case("linear-norm-residual", "packed_linear with input norm and residual")
def _():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, 64, generator=gen).cuda()
    w = (torch.randn(32, 64, generator=gen) / 8).cuda()
    res = torch.randn(12, 32, generator=gen).cuda()
    g, beta = torch.rand(64, generator=gen).cuda() + 0.5, torch.randn(64, generator=gen).cuda()
    out = ops.packed_linear(x, w, None, "none", res, "layer_norm", g, beta, 1e-5)
    normed = torch.nn.functional.layer_norm(x.cpu().double(), (64,), g.cpu().double(),
                                            beta.cpu().double(), 1e-5)
    check(out, normed @ w.cpu().double().t() + res.cpu().double(), torch.float32)


# ---- CUDA graphs -------------------------------------------------------------------------

@case("graph-decode-step", "decode step captured in a CUDA graph, replayed with new metadata")
def _():
    torch.manual_seed(0)
    B, hidden, hq, hkv, d, bs, width = 4, 256, 8, 2, 64, 16, 32
    dtype = torch.bfloat16
    w = (torch.randn((hq + 2 * hkv) * d, hidden) / 16).to(dtype).cuda()
    k_cache = torch.randn(B * width + 4, bs, hkv, d).to(dtype).cuda()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(B * width + 4)[:B * width].view(B, width).to(torch.int32).cuda()
    x = torch.empty(B, hidden, dtype=dtype, device="cuda")
    slots = torch.empty(B, dtype=torch.int64, device="cuda")
    ctx = torch.empty(B, dtype=torch.int32, device="cuda")
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")

    def step(kc, vc):
        qkv = ops.packed_linear(x, w, None, "none").view(B, hq + 2 * hkv, d)
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        ops.store_kv(k, v, kc, vc, slots)
        return ops.ragged_attention(q, kc, vc, cu, ctx, table, d ** -0.5)

    def set_inputs(contexts):
        x.copy_(torch.randn(B, hidden).to(dtype))
        host_table = table.cpu()
        slots.copy_(torch.tensor([int(host_table[r, (c - 1) // bs]) * bs + (c - 1) % bs
                                  for r, c in enumerate(contexts)]))
        ctx.copy_(torch.tensor(contexts, dtype=torch.int32))

    set_inputs([37, 300, 5, 500])
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(k_cache, v_cache)
    for contexts in ([37, 300, 5, 500], [38, 301, 6, 501], [200, 3, 40, 7]):
        set_inputs(contexts)
        graph.replay()
        eager = step(k_eager, v_eager)
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, eager)
        torch.testing.assert_close(k_cache, k_eager)


# ---- the model ---------------------------------------------------------------------------

def model_check() -> bool:
    """orca-tiny (float32) on CUDA, decode iterations from CUDA graphs, against the CPU."""
    from orca_ext.batch import ScheduledRequest, SchedulerOutput
    from orca_ext.executor import KVCache, ModelRunner
    from orca_ext.kv import SlotAllocator
    from orca_ext.model import load_model
    from orca_ext.sampling_params import SamplingParams

    class Recorder:
        def __init__(self, sampler):
            self.sampler, self.logits = sampler, []

        def drop(self, ids):
            self.sampler.drop(ids)

        def __call__(self, logits, requests):
            self.logits.append(logits.float().cpu())
            return self.sampler(logits, requests)

    prompts = [list(b"Hello, my name is"), list(b"The capital of France is"), list(b"1 2 3")]
    params = SamplingParams(temperature=0.0)
    results, fed = {}, []  # fed: the CPU run's tokens, fed to the CUDA run too
    for device in ("cpu", "cuda"):
        loaded = load_model("orca-tiny", "float32", device)
        runner = ModelRunner(loaded.model, KVCache(loaded.config, 16, 16, torch.float32, device),
                             SlotAllocator(16, 16))
        runner.sampler = Recorder(runner.sampler)
        done = {}
        for r, p in enumerate(prompts):
            runner.allocator.allocate(r, len(p) + 16)
            done[r] = len(p)
        out = runner.execute(SchedulerOutput(0, [ScheduledRequest(r, p, 0, params, p, [])
                                                 for r, p in enumerate(prompts)]))
        tokens = dict(enumerate(out.sampled_token_ids))
        for i in range(12):
            running = list(range(len(prompts))) if i % 3 else [0, 2]
            if device == "cpu":
                fed.append([tokens[r] for r in running])
            scheduled = [ScheduledRequest(r, [t], done[r], params, prompts[r], [])
                         for r, t in zip(running, fed[i])]
            for r in running:
                done[r] += 1
            out = runner.execute(SchedulerOutput(i + 1, scheduled))
            tokens.update(zip(running, out.sampled_token_ids))
        results[device] = runner.sampler.logits
        if device == "cuda":
            print(f"  CUDA graph replays: {runner.graphs.replays if runner.graphs else 'off'}",
                  flush=True)
    worst = max((a - b).abs().max().item() for a, b in zip(results["cpu"], results["cuda"]))
    ok = worst < 1e-3
    print(f"{'OK' if ok else 'FAIL'} model orca-tiny float32 CUDA vs CPU logits over "
          f"{len(results['cpu'])} iterations: max |diff| {worst:.3g}", flush=True)
    return ok


def context_poisoned() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() != 2
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="only the sanitizer-sized cases")
    parser.add_argument("--after", help="skip the cases up to and including this one")
    parser.add_argument("--model", action="store_true", help="the orca-tiny check instead")
    parser.add_argument("--list", action="store_true", help="print the case names")
    args = parser.parse_args(argv)
    if args.list:
        for name, what, small, _ in CASES:
            print(f"{name:<24} {what}{'' if small else '  (not --small)'}")
        return 0
    if not (torch.cuda.is_available() and orca_ext.has_cuda()):
        print("FAIL setup no GPU or no CUDA build of orca_ext "
              f"(cuda available: {torch.cuda.is_available()}, has_cuda: {orca_ext.has_cuda()})",
              flush=True)
        return 1
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, orca_ext from "
          f"{Path(orca_ext.__file__).parent}", flush=True)
    if args.model:
        return 0 if model_check() else 1
    names = [name for name, _, _, _ in CASES]
    if args.after is not None and args.after not in names:
        print(f"FAIL setup --after: no case named {args.after!r}", flush=True)
        return 1
    start = names.index(args.after) + 1 if args.after is not None else 0
    failures = 0
    for name, _, small, run in CASES[start:]:
        if args.small and not small:
            continue
        try:
            run()
            torch.cuda.synchronize()
            print(f"OK {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - every failure is reported by name
            failures += 1
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"FAIL {name} {type(exc).__name__}: {first[:300]}", flush=True)
            if context_poisoned():
                print(f"ABORT {name}", flush=True)
                return 2
    print(f"smoke: {failures} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
