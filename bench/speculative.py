"""Speculative decoding against none, on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

Workloads, each run with speculation off and on in the same process, alternating, the medians
of ``--repeats`` pairs reported:

- ``edit``: one stream, greedy; a function given in the prompt, to be rewritten with a small
  change (input-grounded: most output tokens copy the prompt), n-gram proposals. The outputs
  must be the same text.
- ``prose``: one stream, greedy, an open-ended story, n-gram proposals.
- ``batch``: 32 concurrent requests (the Orca workload: short chats), n-gram, throughput.
- ``draft``: one stream, greedy, the edit prompt; SmolLM2 Q4_1 drafting for SmolLM2 bfloat16.
- ``--crossover``: the decode step's time against its number of tokens (one request, its KV
  at ``--context``), which sets ``DEFAULT_MAX_BATCH_TOKENS``.

Decode speed is output tokens after the first over the time after the first token (TTFT out).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from orca_ext import LLM, SamplingParams

EDIT_CODE = '''def merge_intervals(intervals):
    """Merge overlapping intervals given as (start, end) pairs."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def total_covered(intervals):
    """The total length covered by the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
EDIT = [{"role": "user", "content": "Rewrite this Python code, renaming the variable `merged` "
         "to `result` everywhere. Output only the code.\n\n```python\n" + EDIT_CODE + "```"}]
PROSE = [{"role": "user", "content": "Write a long, imaginative story about a lighthouse keeper "
          "who finds a strange map washed ashore."}]
CHATS = ["What is the capital of France?", "Explain photosynthesis briefly.",
         "Give me three tips for learning to cook.", "What is a prime number?",
         "Describe the water cycle.", "Why is the sky blue?", "How do vaccines work?",
         "Suggest a name for a pet turtle."]

NGRAM = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def _prompt(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.engine.tokenize(messages)[1]


def one_stream(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int], float]:
    """(decode tokens/s after the first token, token ids, acceptance in this run)."""
    before = llm.engine.stats()
    engine = llm.engine
    engine.add_request("bench", prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                       stream=True)
    first = time.perf_counter()
    seen = 0
    out = None
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                if seen == 0 and out.outputs[0].token_ids:
                    first = time.perf_counter()
                seen = len(out.outputs[0].token_ids)
    end = time.perf_counter()
    ids = out.outputs[0].token_ids
    after = engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return (len(ids) - 1) / (end - first), ids, accepted / drafted if drafted else 0.0


def batch_throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def paired(name: str, off, on, repeats: int) -> tuple[float, float]:
    """Medians of alternating runs of ``off`` and ``on`` (each returns a rate)."""
    rates_off, rates_on = [], []
    for _ in range(repeats):
        rates_off.append(off())
        rates_on.append(on())
    a, b = statistics.median(rates_off), statistics.median(rates_on)
    print(f"{name:<34} off {a:8.1f} tok/s   on {b:8.1f} tok/s   ratio {b / a:5.2f}x")
    return a, b


def crossover(llm: LLM, context: int, sizes: list[int]) -> None:
    """Decode-step time against its tokens: one request verifying ``n - 1`` proposals."""
    from orca_ext.batch import NewRequestData, ScheduledRequest, SchedulerOutput

    runner = llm.engine.executor
    prompt = list(range(1000, 1000 + context))
    block = runner.kv_cache.block_size
    blocks = list(range(-(-(context + max(sizes)) // block)))
    params = SamplingParams(temperature=0)
    runner.execute(SchedulerOutput(0, [ScheduledRequest(0, prompt, 0, blocks)],
                                   [NewRequestData(0, context, params)]))
    print(f"decode step at context {context}: tokens -> ms (per token)")
    for n in sizes:
        def step() -> None:
            runner.execute(SchedulerOutput(1, [ScheduledRequest(
                0, [5] * n, context, [], num_spec_tokens=n - 1)]))
        for _ in range(3):
            step()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(f"  {n:4d} tokens {ms:8.2f} ms  ({ms / n:6.2f} ms/token)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="edit,prose,batch,draft")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--crossover", action="store_true")
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, {time.strftime('%Y-%m-%d')}")
    workloads = args.workloads.split(",")
    if args.crossover:
        crossover(LLM(kv_cache_tokens=4096), args.context, [1, 2, 3, 4, 6, 8, 12, 16, 24, 32,
                                                             48, 64])
        return
    off = LLM(kv_cache_tokens=16384, enable_prefix_caching=False)
    on = LLM(kv_cache_tokens=16384, enable_prefix_caching=False, speculative_config=NGRAM)
    for name, messages in (("edit", EDIT), ("prose", PROSE)):
        if name not in workloads:
            continue
        prompt = _prompt(off, messages)
        results = {}

        def run(llm: LLM, key: str) -> float:
            rate, ids, acceptance = one_stream(llm, prompt, args.max_tokens)
            results[key] = (ids, acceptance)
            return rate

        paired(f"{name}: one stream, n-gram", lambda: run(off, "off"), lambda: run(on, "on"),
               args.repeats)
        same = results["off"][0] == results["on"][0]
        print(f"  {len(results['on'][0])} tokens, same text: {same}, acceptance "
              f"{results['on'][1]:.2f}")
    if "batch" in workloads:
        prompts = [_prompt(off, [{"role": "user", "content": CHATS[i % len(CHATS)]}])
                   for i in range(32)]
        paired("batch: 32 requests, n-gram", lambda: batch_throughput(off, prompts, 128),
               lambda: batch_throughput(on, prompts, 128), args.repeats)
    if "draft" in workloads:
        del off, on
        target = LLM(kv_cache_tokens=8192, dtype="bfloat16", quantization="none",
                     enable_prefix_caching=False)
        drafted = LLM(kv_cache_tokens=8192, dtype="bfloat16", quantization="none",
                      enable_prefix_caching=False, speculative_config={
                          "method": "draft_model", "model": "smollm2-135m-instruct",
                          "num_speculative_tokens": 4})
        for name, messages in (("edit", EDIT), ("prose", PROSE)):
            prompt = _prompt(target, messages)
            results = {}

            def run(llm: LLM, key: str) -> float:
                rate, ids, acceptance = one_stream(llm, prompt, args.max_tokens)
                results[key] = (ids, acceptance)
                return rate

            paired(f"draft Q4_1 -> bf16, {name}", lambda: run(target, "off"),
                   lambda: run(drafted, "on"), args.repeats)
            print(f"  same text: {results['off'][0] == results['on'][0]}, acceptance "
                  f"{results['on'][1]:.2f}")


if __name__ == "__main__":
    main()
