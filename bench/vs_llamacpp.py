"""One stream, ours against llama.cpp on the same GGUF file and the same threads, in one run:
prefill tok/s of a prompt of ``--prompt-tokens`` random token ids and greedy decode tok/s over
``--decode-tokens`` tokens (EOS off). Ours: the file's stored formats (float32 activations, the
engine's default for a GGUF) and its weights dequantized to bfloat16.

    pip install llama-cpp-python==0.3.36   # builds llama.cpp with -march=native (~7 min, 2 cores)
    python bench/vs_llamacpp.py [--model smollm2-135m-instruct] [--threads 2]
        [--prompt-tokens 512] [--decode-tokens 128] [--repeats 3] [--extra-bufts]

llama.cpp runs through llama-cpp-python's C API (``llama_decode`` on one sequence: the prompt as
one batch, then one token a step, argmax of its logits). Its model loads with
``use_extra_bufts = False`` unless ``--extra-bufts``: on an AMX VM llama.cpp's AMX repacking of
Q4_1 died with "Illegal instruction" (issue 25), so its CPU kernels run on the stored blocks.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from orca_ext import LLM, SamplingParams
from orca_ext.model import load_model
from orca_ext.model.loader import load_model_info, resolve_model_path


def ours(model: str, prompt: list[int], decode_tokens: int, repeats: int,
         **load: object) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one request through LLM, the best of ``repeats`` after
    one warm-up request (decode: the request's time less its prefill's)."""
    llm = LLM(load_model(model, **load), max_batch_size=1,
              kv_cache_tokens=len(prompt) + decode_tokens + 16)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], greedy, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], greedy, use_tqdm=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=decode_tokens + 1,
                                              ignore_eos=True), use_tqdm=False)
        rates.append((len(prompt) / prefill,
                      decode_tokens / (time.perf_counter() - start - prefill)))
    return max(r[0] for r in rates), max(r[1] for r in rates)


def llamacpp(path: str, prompt: list[int], decode_tokens: int, threads: int,
             extra_bufts: bool, repeats: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one sequence in a fresh context per pass, the best of
    ``repeats`` after one warm-up pass."""
    import llama_cpp as lc

    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.use_extra_bufts = extra_bufts
    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    results = []
    for _ in range(1 + repeats):
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = len(prompt) + decode_tokens + 16
        ctx_params.n_batch = ctx_params.n_ubatch = len(prompt)
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx = lc.llama_init_from_model(model, ctx_params)
        tokens = (lc.llama_token * len(prompt))(*prompt)
        start = time.perf_counter()
        if lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, len(prompt))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(decode_tokens):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            step = (lc.llama_token * 1)(int(logits.argmax()))
            if lc.llama_decode(ctx, lc.llama_batch_get_one(step, 1)) != 0:
                raise RuntimeError("llama_decode failed on a decode step")
        decode = time.perf_counter() - start
        lc.llama_free(ctx)
        results.append((len(prompt) / prefill, decode_tokens / decode))
    lc.llama_model_free(model)
    return max(r[0] for r in results[1:]), max(r[1] for r in results[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes per engine, the best reported (a shared VM stalls)")
    parser.add_argument("--extra-bufts", action="store_true",
                        help="let llama.cpp repack weights into its extra buffer types (AMX)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    rng = np.random.default_rng(0)
    vocab = load_model_info(args.model).config.vocab_size
    prompt = rng.integers(100, vocab, args.prompt_tokens).tolist()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")
    print(f"{path}\n{cpu}, {args.threads} threads, prompt {args.prompt_tokens} tokens, decode "
          f"{args.decode_tokens} tokens; llama.cpp use_extra_bufts = {args.extra_bufts}",
          flush=True)
    rows = [
        ("ours, stored formats (float32 activations)", ours(path, prompt, args.decode_tokens,
                                                            args.repeats, dtype="float32")),
        ("ours, dequantized bfloat16", ours(path, prompt, args.decode_tokens, args.repeats,
                                            dtype="bfloat16", quantization="none")),
        ("llama.cpp, the file as stored", llamacpp(path, prompt, args.decode_tokens,
                                                   args.threads, args.extra_bufts,
                                                   args.repeats)),
    ]
    print(f"\n{'engine':<46} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, (prefill, decode) in rows:
        print(f"{name:<46} {prefill:14.1f} {decode:13.1f}")
    (p_ours, d_ours), (_, d_bf16), (p_cpp, d_cpp) = (r for _, r in rows)
    print(f"\nours stored / llama.cpp: prefill {p_ours / p_cpp:.2f}x, decode {d_ours / d_cpp:.2f}x")
    print(f"ours stored / ours bfloat16: decode {d_ours / d_bf16:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
