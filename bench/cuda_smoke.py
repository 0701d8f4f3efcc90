"""One case per CUDA kernel path against the reference, each followed by a synchronize.

    python3 bench/cuda_smoke.py [--small] [--no-cublas] [--after CASE] [--model] [--list]

The cases are tests/test_cuda.py's (its references and tolerances), picked to reach every kernel
path once and run in a fixed order. Prints ``OK <case>`` or ``FAIL <case> <error>`` (flushed) as
each case ends, so that a fault - which the synchronize after each case surfaces - names its
case even when it kills the process. An illegal address poisons the CUDA context and every later
case would fail with the same error: the script then prints ``ABORT <case>`` and exits 2; rerun
with ``--after <case>`` (in a new process) for the rest. ``--small`` keeps the cases
compute-sanitizer can afford; ``--no-cublas`` skips the cases whose GEMMs are cuBLAS's (their
own kernels use no shared memory, so racecheck has nothing of ours to check there); ``--model``
compares orca-tiny's logits on CUDA (CUDA graphs on) with the CPU's instead. Exit status: 0 all
OK, 1 some FAIL, 2 aborted. Run it outside the source tree so that the installed build of
orca_ext is imported (bench/gpu_check.sh does).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_cuda as tc  # noqa: E402

import orca_ext  # noqa: E402
from orca_ext import ops  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ACTIVATIONS = ("none", "gelu_tanh", "relu", "silu_and_mul")
Case = Callable[[], None]
CASES: list[tuple[str, str, bool, bool, Case]] = []  # (name, what, small, cublas, run)


def case(name: str, what: str, run: Case, small: bool = True, cublas: bool = False) -> None:
    CASES.append((name, what, small, cublas, run))


def each(*runs: Case) -> Case:
    def run() -> None:
        for r in runs:
            r()
    return run


# ---- ragged_attention --------------------------------------------------------------------
attention = tc.test_attention_tensor_cores
case("attn-tc-decode", "tensor-core decode tiles, bf16, D=128, GQA",
     lambda: attention(BF16, 128, "decode", (8, 2), 16))
case("attn-tc-prefill", "tensor-core prefill tiles, fp16, D=64",
     lambda: attention(FP16, 64, "prefill", (8, 2), 16))
case("attn-tc-split-merge", "split-KV partials + merge kernel",
     lambda: attention(BF16, 128, "long-decode", (8, 2), 16))
case("attn-tc-chunked-prefill", "chunked prefill over cached KV, split",
     lambda: attention(BF16, 64, "long-prefill", (8, 2), 16))
case("attn-tc-head-dims", "head dims 32 / 80 / 96, MQA, MHA, block sizes 5 / 1 / 16",
     each(lambda: attention(BF16, 32, "mixed", (8, 1), 5),
          lambda: attention(FP16, 80, "mixed", (4, 4), 1),
          lambda: attention(BF16, 96, "decode", (8, 2), 16)))
case("attn-split-vs-unsplit", "split vs attn_max_splits=1 vs attn_max_ctas=2",
     tc.test_attention_forced_split_no_split_and_capped_grid_agree)
case("attn-capped-grid", "attn_max_ctas=2: many items per CTA, the same bits",
     lambda: tc.test_attention_capped_grid_is_bitwise_the_same("mixed", 2))
case("attn-simple", "simple kernel: fp32, and bf16 at head dims 40 / 256",
     each(lambda: tc.test_attention_other_head_dims(FP32, 40),
          lambda: tc.test_attention_other_head_dims(BF16, 256)))
case("attn-padded-table", "block table padded far past the contexts",
     tc.test_attention_wide_block_table)
case("attn-invalid-metadata", "invalid metadata is memory-safe (values unchecked)",
     tc.test_attention_invalid_metadata_is_memory_safe)
case("attn-b512", "B=512 decode, several items per CTA",
     tc.test_attention_decode_batch_512_many_items_per_cta, small=False)
case("attn-b8192", "B=8192 decode (the tensor-core kernel's largest batch)",
     lambda: tc.test_attention_batch_at_the_kernel_limit(8192), small=False)
case("attn-prefill-4096", "a 4096-token prefill", tc.test_attention_prefill_4096_tokens,
     small=False)


# ---- store_kv ----------------------------------------------------------------------------
def store_kv_vector_widths() -> None:
    for d in (64, 4, 2, 1):  # bf16 rows of 128, 8, 4 and 2 bytes
        k_cache = torch.zeros(4, 4, 2, d, device="cuda", dtype=BF16)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(4, 2, d, device="cuda", dtype=BF16)
        ops.store_kv(key, key * 2, k_cache, v_cache, torch.tensor([3, -1, 15, 10 ** 9],
                                                                  device="cuda"))
        expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        flat_k, flat_v = expected_k.view(16, 2, d), expected_v.view(16, 2, d)
        flat_k[3], flat_v[3] = key[0], key[0] * 2
        flat_k[15], flat_v[15] = key[2], key[2] * 2
        torch.cuda.synchronize()
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), f"D={d}"


case("store-kv", "16 / 8 / 4 / 2-byte vectors; negative and past-the-end slots skipped",
     store_kv_vector_widths)
case("store-kv-fp8", "store_kv into an fp8 e4m3 cache from bf16 / fp16 / fp32, saturating",
     each(*(lambda d=d: tc.test_store_kv_fp8_rounds_as_torch_casts(d) for d in (BF16, FP16, FP32))))
fp8_attention = tc.test_attention_fp8_cache_against_the_widened_cache
case("attn-fp8-cache", "an fp8 e4m3 cache: tensor-core decode split + merge, prefill, simple",
     each(lambda: fp8_attention(BF16, 128, "long-decode"), lambda: fp8_attention(FP16, 64, "mixed"),
          lambda: fp8_attention(FP32, 64, "decode"), lambda: fp8_attention(BF16, 40, "prefill")))

# ---- packed_linear -----------------------------------------------------------------------
linear = tc.test_packed_linear_paths
case("linear-skinny", "skinny kernel (T <= 8), every activation, bf16 and fp32",
     each(*(lambda a=a: linear(BF16, a, 3, 256) for a in ACTIVATIONS),
          *(lambda a=a: linear(FP32, a, 8, 256) for a in ACTIVATIONS)))
case("linear-cublaslt", "cuBLASLt with fused epilogues (T = 64), every activation, fp16",
     each(*(lambda a=a: linear(FP16, a, 64, 256) for a in ACTIVATIONS)), cublas=True)
case("linear-no-epilogue", "linear_no_epilogue: plain GEMM + bias/activation kernel",
     each(*(lambda a=a: tc.test_packed_linear_without_cublaslt_epilogue(BF16, a)
            for a in ACTIVATIONS)), cublas=True)
case("linear-odd-k", "K not a multiple of 8: cuBLASLt at any T",
     each(lambda: linear(FP16, "gelu_tanh", 3, 100), lambda: linear(BF16, "silu_and_mul", 9, 100)),
     cublas=True)


def linear_norm_residual() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, 64, generator=gen).cuda()
    w = (torch.randn(32, 64, generator=gen) / 8).cuda()
    res = torch.randn(12, 32, generator=gen).cuda()
    g, beta = torch.rand(64, generator=gen).cuda() + 0.5, torch.randn(64, generator=gen).cuda()
    out = ops.packed_linear(x, w, None, "none", res, "layer_norm", g, beta, 1e-5)
    normed = torch.nn.functional.layer_norm(x.cpu().double(), (64,), g.cpu().double(),
                                            beta.cpu().double(), 1e-5)
    tc.assert_close(out, normed @ w.cpu().double().t() + res.cpu().double(), FP32)


case("linear-norm-residual", "input layer norm and residual (ATen around the kernels)",
     linear_norm_residual, cublas=True)

# ---- concurrency, CUDA graphs, large allocations -----------------------------------------
case("graph-decode-step", "linear -> store_kv -> attention captured, replayed with new metadata",
     lambda: tc.test_decode_step_cuda_graph_matches_eager(4),
     small=False)  # capture needs the caching allocator, which the sanitizer runs turn off
case("threads", "launches from four host threads on their own streams",
     tc.test_launches_from_several_host_threads, small=False)
case("runner-graphs", "the runner's decode CUDA graphs against its eager iterations",
     lambda: tc.test_runner_decode_graphs_match_eager(BF16), small=False)
case("kv-past-2-31", "a KV cache of more than 2^31 elements (8.6 GB)",
     tc.test_kv_cache_past_2_31_elements, small=False)


# ---- the model ---------------------------------------------------------------------------

def model_check() -> bool:
    """orca-tiny (float32) on CUDA, decode iterations from CUDA graphs, against the CPU."""
    from orca_ext.batch import NewRequestData, ScheduledRequest, SchedulerOutput
    from orca_ext.kv import KVCache, SlotAllocator
    from orca_ext.model import load_model
    from orca_ext.runner import ModelRunner
    from orca_ext.sampling_params import SamplingParams

    prompts = [list(b"Hello, my name is"), list(b"The capital of France is"), list(b"1 2 3")]
    params = SamplingParams(temperature=0.0)
    results, fed = {}, []  # fed: the CPU run's tokens, fed to the CUDA run too
    for device in ("cpu", "cuda"):
        loaded = load_model("orca-tiny", "float32", device)
        runner = ModelRunner(loaded.model, KVCache(loaded.config, 16, 16, torch.float32, device))
        runner.sampler = tc.RecordingSampler(runner.sampler)
        allocator = SlotAllocator(16, 16)
        done = {}
        for r, p in enumerate(prompts):
            allocator.allocate(r, len(p) + 16)
            done[r] = len(p)
        out = runner.execute(SchedulerOutput(
            0, [ScheduledRequest(r, p, 0, allocator.blocks(r)) for r, p in enumerate(prompts)],
            [NewRequestData(r, len(p), params) for r, p in enumerate(prompts)]))
        tokens = dict(enumerate(out.sampled_token_ids))
        for i in range(12):
            running = list(range(len(prompts))) if i % 3 else [0, 2]
            if device == "cpu":
                fed.append([tokens[r] for r in running])
            scheduled = [ScheduledRequest(r, [t], done[r]) for r, t in zip(running, fed[i])]
            for r in running:
                done[r] += 1
            out = runner.execute(SchedulerOutput(i + 1, scheduled))
            tokens.update(zip(running, out.sampled_token_ids))
        results[device] = runner.sampler.logits
        if device == "cuda":
            print(f"  CUDA graph replays: {runner.graphs.replays if runner.graphs else 'off'}",
                  flush=True)
    worst = max((a.cpu() - b.cpu()).abs().max().item()
                for a, b in zip(results["cpu"], results["cuda"]))
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
    parser.add_argument("--no-cublas", action="store_true",
                        help="skip the cases whose GEMMs are cuBLAS's")
    parser.add_argument("--after", help="skip the cases up to and including this one")
    parser.add_argument("--model", action="store_true", help="the orca-tiny check instead")
    parser.add_argument("--list", action="store_true", help="print the case names")
    args = parser.parse_args(argv)
    if args.list:
        for name, what, small, cublas, _ in CASES:
            print(f"{name:<24} {what}{'' if small else '  (not --small)'}"
                  f"{'  (cuBLAS)' if cublas else ''}")
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
    names = [name for name, *_ in CASES]
    if args.after is not None and args.after not in names:
        print(f"FAIL setup --after: no case named {args.after!r}", flush=True)
        return 1
    start = names.index(args.after) + 1 if args.after is not None else 0
    failures = 0
    for name, _, small, cublas, run in CASES[start:]:
        if (args.small and not small) or (args.no_cublas and cublas):
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
