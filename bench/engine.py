"""Offline throughput of iteration-level scheduling (``orca``) against request-level batching
(``request``): same model, same workload, same process.

    python bench/engine.py [--model orca-tiny] [--dtype float32] [--device cpu]
                           [--num-requests 64] [--max-batch-size 16] [--kv-cache-tokens N]
                           [--prompt-len 32 512] [--output-len 1 128] [--seed 0]
                           [--policies orca request]

Orca's synthetic workload: prompt lengths ~U[32, 512] of random tokens, output lengths
~U[1, 128] with ignore_eos, every request arriving at once. The KV cache holds
``max_batch_size`` of the longest requests unless ``--kv-cache-tokens`` says otherwise, so the
batch size, not memory, bounds both policies. Prints tokens/s per policy and their ratio.
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
    args = parser.parse_args()

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
    for policy in args.policies:
        llm = LLM(loaded, max_batch_size=args.max_batch_size, kv_cache_tokens=kv_tokens,
                  block_size=args.block_size, policy=policy)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_output
        throughput[policy] = num_output / elapsed
        print(f"{policy:>8}: {elapsed:8.2f} s  {args.num_requests / elapsed:7.2f} req/s  "
              f"{num_output / elapsed:9.1f} output tok/s  "
              f"{(num_prompt + num_output) / elapsed:9.1f} total tok/s")
    if {"orca", "request"} <= throughput.keys():
        print(f"orca / request throughput: {throughput['orca'] / throughput['request']:.2f}x")


if __name__ == "__main__":
    main()
