"""A GGUF model in its stored formats against the same weights dequantized: resident weight
memory, the share of equal greedy chat answers, and one-stream decode speed (ours quantized,
float32 and bfloat16).

    python bench/quantized_model.py [--model smollm2-135m-instruct] [--max-tokens 64]
        [--decode-tokens 128] [--batch-sizes 1 8] [--stored-dtype float32]

``ORCA_QUANT_ISA`` forces the quantized kernels' ISA path (portable, avx2, avx512, avx512_vnni,
amx_int8), as in the tests.

Memory: the bytes of the model's parameters and buffers, and the process's RSS growth over the
load (which also holds what the loader parsed and the allocator kept). Greedy: 32 chat
questions through the file's chat template (as plain text for a model without one),
``--max-tokens`` each, the stored formats at each ``--batch-sizes`` (1: one request at a time,
the 1-2 token kernels) against the float32 weights. Decode: one request of a short prompt,
``--decode-tokens`` tokens with EOS off, after one warm-up request.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time

import torch

from orca_ext import LLM, SamplingParams
from orca_ext.model import load_model

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "How many legs does a spider have?", "Give me three tips for learning Python.",
    "What is 12 times 7?", "Explain in one sentence what a CPU does.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Name three primary colors.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What is photosynthesis?",
    "Suggest a name for a pet goldfish.", "How do I reverse a list in Python?",
    "What is the largest planet in the solar system?", "Describe a cat in two sentences.",
    "What does HTTP stand for?", "Give me a recipe idea with eggs and spinach.",
    "What is the square root of 81?", "Write a short motivational quote.",
    "How many continents are there?", "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.", "What is a prime number?",
    "Recommend a book for a long flight.", "How does a rainbow form?",
    "What is the chemical symbol for gold?", "Write a limerick about a programmer.",
    "What are the three states of matter?", "How can I improve my sleep?",
    "What year did humans first land on the Moon?", "Explain what a database index is.",
]


def rss_bytes() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


def decode_rate(llm: LLM, tokens: int) -> float:
    """tok/s of one stream's decode steps (the prompt's prefill timed apart and subtracted)."""
    prompt = "Tell me a long story about a lighthouse keeper."
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True),
                 use_tqdm=False)
    return tokens / (time.perf_counter() - start - prefill)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--stored-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the stored formats' activation dtype")
    args = parser.parse_args()
    print(f"{args.model}, {torch.get_num_threads()} threads, stored formats with "
          f"{args.stored_dtype} activations", flush=True)
    gc.collect()
    before = rss_bytes()
    native = load_model(args.model, args.stored_dtype)
    gc.collect()
    growth = rss_bytes() - before
    print(f"stored formats: weights {weight_bytes(native.model) / 1e6:.1f} MB, RSS growth "
          f"{growth / 1e6:.1f} MB", flush=True)
    dequantized = load_model(args.model, "float32", quantization="none")
    print(f"dequantized float32: weights {weight_bytes(dequantized.model) / 1e6:.1f} MB",
          flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers, rates = {}, {}
    runs = [("stored", native, b) for b in args.batch_sizes] + [("float32", dequantized, 8)]
    for name, loaded, batch_size in runs:
        llm = LLM(loaded, max_batch_size=batch_size)
        # A base model without a chat template (Gemma 3 270M) continues the questions as text.
        outputs = (llm.chat(chats, params, use_tqdm=False)
                   if loaded.info.chat_template is not None
                   else llm.generate(QUESTIONS, params, use_tqdm=False))
        answers[name, batch_size] = [list(c.outputs[0].token_ids) for c in outputs]
        if name not in rates:
            rates[name] = decode_rate(llm, args.decode_tokens)
        del llm
    del native, dequantized
    gc.collect()
    rates["bfloat16"] = decode_rate(LLM(load_model(args.model, "bfloat16",
                                                   quantization="none")), args.decode_tokens)
    for batch_size in args.batch_sizes:
        equal = sum(a == b for a, b in zip(answers["stored", batch_size], answers["float32", 8]))
        print(f"greedy answers equal, stored (batch {batch_size}) vs dequantized float32: "
              f"{equal} / {len(QUESTIONS)}, {args.max_tokens} tokens at most")
    for name, rate in rates.items():
        print(f"one-stream decode, {name}: {rate:.1f} tok/s")
    print(f"stored / bfloat16: {rates['stored'] / rates['bfloat16']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
