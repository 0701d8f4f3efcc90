"""Quality: sliding-window perplexity, ours and transformers on the same weights, per dtype; for
a lower-precision dtype (or ours quantized) also the mean KL divergence of its next-token
distributions from the float32 ones.

    python bench/perplexity.py [--model smollm2-135m-instruct] [--text FILE]
        [--dtypes float32 bfloat16] [--window 512] [--stride 256] [--max-tokens 4096]
        [--quantization none|stored|q8_0|q4_0|q4_1] [--decode-steps]
        [--kv-cache-dtypes auto int8]

The text defaults to the English documentation every Python ships (``pydoc_data/topics.py``).
Each window of ``--window`` tokens (moving by ``--stride``) scores its tokens after the first
``window - stride`` (all of them in the first window), as Hugging Face's perplexity guide does.
transformers loads the same weights: a GGUF through its own GGUF loader (or, with
``--transformers-from folder``, from our dequantized weights saved as a Hugging Face folder),
anything else from our model saved as a Hugging Face folder. The KL reference is transformers'
float32 distribution, for both sides. ``--quantization`` loads ours quantized (``stored``: a
GGUF file's formats as stored, the engine's default) against transformers on the dequantized
weights: native against dequantized float32. ``--decode-steps`` scores ours one token per step
(a window's prefill only up to its first scored position), as decoding computes them.
``--kv-cache-dtypes auto int8`` scores ours once per KV cache dtype (``int8``: per token and head
scales), each against the same references.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from orca_ext.kv import KVCache, SlotAllocator, resolve_kv_cache_dtype
from orca_ext.model import AttentionMetadata, LoadedModel, load_model, save_pretrained_folder
from orca_ext.model.loader import load_model_info


def default_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def our_logits(loaded: LoadedModel, tokens: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """float32 logits of every position of one window, as one prefill."""
    n = len(tokens)
    allocator = SlotAllocator(-(-n // 16), 16)
    allocator.allocate(0, n)
    meta = allocator.build_metadata([0], [0], [n])
    kv_cache = KVCache(loaded.config, -(-n // 16), 16, kv_dtype)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(tokens), meta[4], kv_cache,
                              AttentionMetadata(*meta[:4]))
        return loaded.model.compute_logits(hidden, torch.arange(n)).float()


def our_step_logits(loaded: LoadedModel, tokens: list[int], first: int,
                    kv_dtype: torch.dtype) -> torch.Tensor:
    """float32 logits of positions ``first`` to ``len(tokens) - 2`` of one window (the rest
    zero): the window up to ``first`` as one prefill, then one decode step per token (one-token
    steps, the path decode takes: int8 activations on avx512_vnni for a quantized model)."""
    n = len(tokens)
    allocator = SlotAllocator(-(-n // 16), 16)
    allocator.allocate(0, n)
    kv_cache = KVCache(loaded.config, -(-n // 16), 16, kv_dtype)
    out = torch.zeros(n, loaded.config.vocab_size)
    with torch.inference_mode():
        done = 0
        for end in range(first + 1, n):
            meta = allocator.build_metadata([0], [done], [end - done])
            hidden = loaded.model(torch.tensor(tokens[done:end]), meta[4], kv_cache,
                                  AttentionMetadata(*meta[:4]))
            out[end - 1] = loaded.model.compute_logits(hidden, torch.tensor([end - 1 - done]))[0]
            done = end
    return out


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position within the window) of each window."""
    out, start = [], 0
    while True:
        end = min(start + window, num_tokens)
        out.append((start, end, 0 if start == 0 else window - stride))
        if end == num_tokens:
            return out
        start += stride


def load_transformers(name: str, loaded: LoadedModel, dtype: torch.dtype, scratch: Path,
                      source: str):
    import transformers

    info = load_model_info(name)
    if info.gguf is not None and source == "gguf":
        path = info.gguf.path
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    folder = save_pretrained_folder(loaded, scratch / "hf")
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--transformers-from", choices=("gguf", "folder"), default="gguf",
                        help="a GGUF model: transformers loads the file itself (gguf; its "
                             "non-float32 GGUF models compute in float32 on packed weights) or our "
                             "dequantized weights saved as a Hugging Face folder (folder)")
    parser.add_argument("--quantization", default="none",
                        choices=("none", "stored", "q8_0", "q4_0", "q4_1"),
                        help="our weights: dequantized (none, default), a GGUF file's formats as "
                             "stored (stored), or quantized at load")
    parser.add_argument("--decode-steps", action="store_true",
                        help="ours scores each window's tokens one decode step at a time")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        choices=("auto", "int8"),
                        help="ours with each KV cache dtype (auto always)")
    parser.add_argument("--max-tokens", type=int, default=4096,
                        help="score the first N tokens of the text (0: all)")
    args = parser.parse_args()
    if not 0 < args.stride <= args.window:
        parser.error(f"need 0 < --stride <= --window, got {args.stride} and {args.window}")
    text = args.text.read_text() if args.text else default_text()
    tokenizer = load_model_info(args.model).tokenizer
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    spans = windows(len(tokens), args.window, args.stride)
    print(f"{args.model}: {len(tokens)} tokens of {args.text or 'pydoc_data/topics.py'}, "
          f"{len(spans)} windows of {args.window} (stride {args.stride}), "
          f"{torch.get_num_threads()} threads", flush=True)
    quantization = None if args.quantization == "stored" else args.quantization
    reference: list[torch.Tensor] = []  # transformers' float32 log-probabilities per window
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for dtype_name in ["float32", *[d for d in args.dtypes if d != "float32"]]:
            loaded = load_model(args.model, dtype_name, quantization=quantization)
            # transformers gets float weights: a folder is saved from our dequantized model.
            unquantized = loaded if quantization == "none" else load_model(
                args.model, dtype_name, quantization="none")
            hf = load_transformers(args.model, unquantized, loaded.dtype, Path(scratch),
                                   args.transformers_from)
            del unquantized
            quantized_side = quantization != "none"
            kv_dtypes = {("ours" if name == "auto" else f"ours kv {name}"):
                         resolve_kv_cache_dtype(name, loaded.dtype, "cpu")
                         for name in dict.fromkeys(["auto", *args.kv_cache_dtypes])}
            sums = {"transformers": [0.0, 0.0], **{side: [0.0, 0.0] for side in kv_dtypes}}
            count, start_time = 0, time.perf_counter()
            for i, (start, end, first) in enumerate(spans):
                window = tokens[start:end]
                targets = torch.tensor(window[first + 1:])
                # transformers first: its float32 side is the KL reference.
                sides = [("transformers", lambda: hf_logits(hf, window))]
                sides += [(side, lambda kv=kv: our_step_logits(loaded, window, first, kv)
                           if args.decode_steps else our_logits(loaded, window, kv))
                          for side, kv in kv_dtypes.items()]
                for side, compute in sides:
                    logits = compute()
                    logp = F.log_softmax(logits[first:-1], dim=-1)
                    sums[side][0] += F.nll_loss(logp, targets, reduction="sum").item()
                    if dtype_name == "float32" and side == "transformers":
                        reference.append(logp)
                    elif dtype_name != "float32" or quantized_side:
                        sums[side][1] += F.kl_div(logp, reference[i], log_target=True,
                                                  reduction="sum").item()
                count += len(targets)
            seconds = time.perf_counter() - start_time
            for side, (nll, kl) in sums.items():
                with_kl = dtype_name != "float32" or (quantized_side and side != "transformers")
                results.append((dtype_name, side, math.exp(nll / count),
                                kl / count if with_kl else None))
            print(f"  {dtype_name}: {count} tokens scored in {seconds:.0f} s", flush=True)
            del hf, loaded
    print(f"\nours: quantization {args.quantization}")
    print(f"\n{'dtype':<10} {'engine':<13} {'perplexity':>11} {'mean KL vs float32':>20}")
    for dtype_name, side, ppl, kl in results:
        kl_text = "-" if kl is None else f"{kl:.2e}"
        print(f"{dtype_name:<10} {side:<13} {ppl:11.4f} {kl_text:>20}")
        if side.startswith("ours kv"):
            base = next(p for d, s, p, _ in results if d == dtype_name and s == "ours")
            print(f"{dtype_name}: {side} / ours perplexity = {ppl / base:.5f} "
                  f"({(ppl / base - 1) * 100:+.3f} %)")
    by = {(d, s): p for d, s, p, _ in results}
    for dtype_name in dict.fromkeys(d for d, _, _, _ in results):
        ours, theirs = by[(dtype_name, "ours")], by[(dtype_name, "transformers")]
        print(f"{dtype_name}: ours / transformers perplexity = {ours / theirs:.5f} "
              f"({(ours / theirs - 1) * 100:+.3f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
