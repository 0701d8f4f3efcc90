"""Structured outputs: what the grammar masks cost on the default model's 49,152-token vocabulary.

    python bench/structured.py [--batch-size 32] [--output-len 64] [--steps 48] [--seed 0]

Three figures:
- per-step mask time: one matcher's fill (median, p99) along random walks of every schema of
  the tests' suite (tests/json_schemas.py), each step a token drawn from the mask; and the
  batch fill the engine's worker thread does for ``--batch-size`` matchers at once;
- compile time (p50, p99) of the suite's schemas, the cache cleared before each;
- engine throughput at ``--batch-size`` with every request constrained against none: the same
  prompts, greedy, ``ignore_eos`` and ``--output-len`` tokens each (the constrained ones follow a
  JSON schema they cannot complete in that many tokens), so both runs have the same shapes.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from orca_ext import LLM, SamplingParams
from orca_ext.sampling_params import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from json_schemas import SCHEMAS  # noqa: E402

# A list of people longer than any output here: a JSON mask on every step, never complete.
PEOPLE = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "email": {"type": "string", "format": "email"}}}}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def mask_times(structured, steps: int, seed: int) -> list[float]:
    """Seconds of each single-matcher fill along a random walk per schema."""
    rng = random.Random(seed)
    times = []
    for _, schema in SCHEMAS:
        matcher = structured.compile(StructuredOutputsParams(json=schema))
        mask = torch.empty((1, structured.words), dtype=torch.int32)
        for _ in range(steps):
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), structured.words * 4)
            times.append(time.perf_counter() - start)
            allowed = np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8),
                                                   bitorder="little")[:structured.vocab_size])
            if matcher.is_stopped() or len(allowed) == 0:
                break
            matcher.consume_token(int(rng.choice(allowed)))
    return times


def batch_fill_times(structured, batch_size: int, repeats: int) -> list[float]:
    """Seconds of the engine's whole-batch fill (worker thread and llguidance's pool)."""
    matchers = [structured.compile(StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)][1]))
                for i in range(batch_size)]
    work = list(enumerate(matchers))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        structured.bitmask(work).tensor()
        times.append(time.perf_counter() - start)
    return times


def compile_times(structured) -> list[float]:
    times = []
    for _, schema in SCHEMAS:
        structured._cache.clear()  # time the compile, not the cache
        start = time.perf_counter()
        structured.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - start)
    return times


def throughput(llm: LLM, batch_size: int, output_len: int, constrained: bool) -> float:
    """Output tokens per second of one batch."""
    spec = StructuredOutputsParams(json=PEOPLE) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            structured_outputs=spec)
    prompts = [[{"role": "user", "content": f"List people, number {i}, as JSON."}]
               for i in range(batch_size)]
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return batch_size * output_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48, help="random-walk steps per schema")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(max_batch_size=args.batch_size, max_model_len=512,
              kv_cache_tokens=args.batch_size * 256)
    structured = llm.engine.structured
    walk = mask_times(structured, args.steps, args.seed)
    batch = batch_fill_times(structured, args.batch_size, 200)
    compiled = compile_times(structured)
    print(f"vocabulary {structured.vocab_size} tokens, torch threads {torch.get_num_threads()}")
    print(f"mask, one matcher:   median {statistics.median(walk) * 1e6:7.1f} us   "
          f"p99 {percentile(walk, 99) * 1e6:7.1f} us   ({len(walk)} steps over "
          f"{len(SCHEMAS)} schemas)")
    print(f"mask, batch of {args.batch_size}: median {statistics.median(batch) * 1e6:7.1f} us   "
          f"p99 {percentile(batch, 99) * 1e6:7.1f} us")
    print(f"schema compile:      p50 {statistics.median(compiled) * 1e3:7.2f} ms   "
          f"p99 {percentile(compiled, 99) * 1e3:7.2f} ms   ({len(compiled)} schemas)")

    throughput(llm, args.batch_size, 8, True)  # warm up both paths
    free, constrained = [], []
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both
        free.append(throughput(llm, args.batch_size, args.output_len, False))
        constrained.append(throughput(llm, args.batch_size, args.output_len, True))
    free_rate, constrained_rate = statistics.median(free), statistics.median(constrained)
    print(f"engine, batch {args.batch_size} x {args.output_len} tokens: free "
          f"{free_rate:7.1f} tok/s   all constrained {constrained_rate:7.1f} tok/s   "
          f"ratio {constrained_rate / free_rate:.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
