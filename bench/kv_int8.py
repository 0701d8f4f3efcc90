"""The int8 KV cache against the default one: decode attention at long contexts (op level) and
the share of equal greedy chat answers on the default model.

    python bench/kv_int8.py [--only attention|chats] [--context 4096] [--requests 1 4 8]
        [--max-tokens 64] [--batch-sizes 1 8]

Attention: ``ragged_attention`` decode steps (one query per request) over ``--context``-token
caches of SmolLM2-135M's attention shape (9 query heads on 3 KV heads, head_dim 64, blocks of 16
scattered over the pool), the float32 cache against the int8 one (same values, quantized), for
each number of ``--requests``; the caches (about 3 MB of float32 per request) are larger than
the last-level cache from a few requests on. Chats: the 32 chat questions of
bench/quantized_model.py through the default ``LLM()`` (SmolLM2 Q4_1, float32 activations),
greedy, ``--max-tokens`` each, the int8 cache against the default cache at each
``--batch-sizes``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import row, time_fn  # noqa: E402
from quantized_model import QUESTIONS  # noqa: E402

from orca_ext import LLM, SamplingParams, ops  # noqa: E402
from orca_ext.testing import random_ragged_batch  # noqa: E402


def bench_attention(context: int, requests: list[int]) -> None:
    print(f"== ragged_attention decode, {context}-token contexts, 9 q heads / 3 KV heads, "
          f"head_dim 64, {torch.get_num_threads()} threads ==")
    for n in requests:
        batch = random_ragged_batch([1] * n, [context] * n, 9, 3, 64, 16)
        k8 = torch.zeros(*batch.k_cache.shape[:-1], 68, dtype=torch.int8)
        v8 = torch.zeros_like(k8)
        # Quantized through store_kv: every slot of the pool, as the engine writes them.
        slots = torch.arange(k8.shape[0] * k8.shape[1])
        flat = batch.k_cache.shape[0] * batch.k_cache.shape[1]
        ops.store_kv(batch.k_cache.view(flat, 3, 64), batch.v_cache.view(flat, 3, 64), k8, v8,
                     slots)
        meta = (batch.cu_q_lens, batch.context_lens, batch.block_table, batch.scale)
        base = time_fn(lambda: ops.ragged_attention(batch.q, batch.k_cache, batch.v_cache, *meta))
        ours = time_fn(lambda: ops.ragged_attention(batch.q, k8, v8, *meta))
        print(row(f"{n} requests x {context} tokens: int8 cache", ours, base, "float32"))


def bench_chats(max_tokens: int, batch_sizes: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers = {}
    for kv_cache_dtype in ("auto", "int8"):
        for batch_size in batch_sizes:
            llm = LLM(max_batch_size=batch_size, kv_cache_dtype=kv_cache_dtype)
            answers[kv_cache_dtype, batch_size] = [
                list(c.outputs[0].token_ids) for c in llm.chat(chats, params, use_tqdm=False)]
            del llm
    for batch_size in batch_sizes:
        equal = sum(a == b for a, b in zip(answers["int8", batch_size],
                                           answers["auto", batch_size]))
        print(f"greedy answers equal, int8 KV vs default KV (batch {batch_size}): {equal} / "
              f"{len(QUESTIONS)}, {max_tokens} tokens at most")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["attention", "chats"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    if args.only in (None, "attention"):
        bench_attention(args.context, args.requests)
    if args.only in (None, "chats"):
        bench_chats(args.max_tokens, args.batch_sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
