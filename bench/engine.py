"""Offline throughput of iteration-level scheduling (``orca``) against request-level batching
(``request``): same model, same workload, same process.

    python bench/engine.py [--model orca-tiny] [--dtype float32] [--device cpu]
                           [--num-requests 64] [--max-batch-size 16] [--kv-cache-tokens N]
                           [--prompt-len 32 512] [--output-len 1 128] [--seed 0]
                           [--policies orca request] [--tp 1] [--pp 1] [--threads N]

Orca's synthetic workload: prompt lengths ~U[32, 512] of random tokens, output lengths
~U[1, 128] with ignore_eos, every request arriving at once. The KV cache holds
``max_batch_size`` of the longest requests unless ``--kv-cache-tokens`` says otherwise, so the
batch size, not memory, bounds both policies. Prints tokens/s per policy and their ratio.

With ``--tp``/``--pp`` each policy also runs on ``tp x pp`` worker processes and is compared with
one process (TP=1) given the same total thread count (``--threads``, default: torch's), split
evenly over the workers: on a CPU with few cores the ratio is honest and may be below 1.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from orca_ext.llm import LLM
from orca_ext.model import load_model
from orca_ext.sampling_params import SamplingParams


def workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]],
                                                                 list[SamplingParams]]:
    rng = random.Random(args.seed)
    prompts, params = [], []
    for _ in range(args.num_requests):
        prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(*args.prompt_len))])
        params.append(SamplingParams(temperature=0, ignore_eos=True,
                                     max_tokens=rng.randint(*args.output_len)))
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="orca-tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[1, 128],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["orca", "request"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    parser.add_argument("--threads", type=int, default=None,
                        help="total CPU threads (with --tp/--pp: split over the workers)")
    args = parser.parse_args()
    workers = args.tp * args.pp
    per_worker = max(1, (args.threads or torch.get_num_threads()) // workers)
    if args.threads or workers > 1:
        torch.set_num_threads(per_worker * workers)  # the TP=1 baseline gets all of them

    loaded = load_model(args.model, args.dtype, args.device)
    prompts, params = workload(args, loaded.config.vocab_size)
    longest = args.prompt_len[1] + args.output_len[1]
    kv_tokens = args.kv_cache_tokens or args.max_batch_size * longest
    num_prompt = sum(map(len, prompts))
    num_output = sum(p.max_tokens for p in params)
    print(f"{args.model} {args.dtype} on {args.device}: {args.num_requests} requests, "
          f"{num_prompt} prompt + {num_output} output tokens, max_batch_size "
          f"{args.max_batch_size}, KV {kv_tokens} tokens")
    throughput = {}

    def run(llm: LLM, label: str) -> float:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_output
        print(f"{label:>8}: {elapsed:8.2f} s  {args.num_requests / elapsed:7.2f} req/s  "
              f"{num_output / elapsed:9.1f} output tok/s  "
              f"{(num_prompt + num_output) / elapsed:9.1f} total tok/s")
        return num_output / elapsed

    for policy in args.policies:
        throughput[policy] = run(LLM(loaded, max_batch_size=args.max_batch_size,
                                     kv_cache_tokens=kv_tokens, block_size=args.block_size,
                                     policy=policy), policy)
        if workers > 1:
            from orca_ext.distributed import ParallelConfig

            with LLM(args.model, dtype=args.dtype, device=args.device.split(":")[0],
                     max_batch_size=args.max_batch_size, kv_cache_tokens=kv_tokens,
                     block_size=args.block_size, policy=policy,
                     parallel_config=ParallelConfig(args.tp, args.pp,
                                                    worker_threads=per_worker)) as llm:
                parallel = run(llm, f"tp{args.tp}pp{args.pp}")
            print(f"{policy} TP={args.tp} x PP={args.pp} ({workers} workers x {per_worker} "
                  f"threads) / TP=1 ({per_worker * workers} threads): "
                  f"{parallel / throughput[policy]:.2f}x")
    if {"orca", "request"} <= throughput.keys():
        print(f"orca / request throughput: {throughput['orca'] / throughput['request']:.2f}x")


if __name__ == "__main__":
    main()
