"""quantized_linear (GGUF q8_0 / q4_0 / q4_1 blocks) against packed_linear on float weights.

    python bench/quantized_linear.py [--tokens 1 4 16 128 512] [--dtypes float32 bfloat16]
                                     [--layers qkv o gate_up down lm_head] [--seconds 0.2]
    python bench/quantized_linear.py --model FILE_OR_NAME [--tokens 512]

SmolLM2-135M's linears (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64, vocab
49152), per token count and activation dtype: the median time of each op and its effective
bandwidth, the weight bytes it reads per call over that time (float weights: 4 or 2 bytes per
weight; blocks: 34, 18 or 20 bytes per 32).
With --model: each distinct linear (format, shape, activation) of a GGUF model in its stored
formats, float32 x: quantized_linear against packed_linear on the same weights dequantized to
float32, median ms and GFLOP/s (2 T N K per call); the output head as its logits call it
(``int8_activations=False``).
ORCA_QUANT_ISA=portable|avx2|avx512|avx512_vnni|amx_int8 forces the quantized kernels' path.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_fn  # noqa: E402

from orca_ext import _C, ops  # noqa: E402
from orca_ext.quantize import quantize_weight  # noqa: E402

# name: (N, K, activation); gate_up is the fused [2I, K] gate and up weight.
LAYERS = {"qkv": (576 + 2 * 192, 576, "none"), "o": (576, 576, "none"),
          "gate_up": (2 * 1536, 576, "silu_and_mul"), "down": (576, 1536, "none"),
          "lm_head": (49152, 576, "none")}
FORMATS = ("q8_0", "q4_0", "q4_1")


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")),
                 "unknown CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("Flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(isa)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 128, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--seconds", type=float, default=0.2, help="minimum timing per case")
    parser.add_argument("--model", help="time this GGUF model's own linears instead")
    args = parser.parse_args()
    isa = _C.get_isa("quant")
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"quantized kernels: {isa}")
    if args.model:
        return model_linears(args.model, args.tokens, args.seconds)
    print(f"{'layer':<8} {'N x K':>12} {'T':>4} {'dtype':<9}"
          + "".join(f" {name:>19}" for name in ("packed_linear", *FORMATS))
          + "   (ms, GB/s of weights)")
    gen = torch.Generator().manual_seed(0)
    for layer in args.layers:
        N, K, act = LAYERS[layer]
        weight = torch.randn(N, K, generator=gen) / K ** 0.5
        blocks = {fmt: quantize_weight(weight, fmt) for fmt in FORMATS}
        for T in args.tokens:
            for dtype in (getattr(torch, d) for d in args.dtypes):
                x = torch.randn(T, K, generator=gen).to(dtype)
                w = weight.to(dtype)
                cases = [(lambda: ops.packed_linear(x, w, None, act), w.numel() * w.element_size())]
                for fmt, q in blocks.items():
                    cases.append((lambda q=q, f=fmt: ops.quantized_linear(x, q, f, K, None, act),
                                  q.numel()))
                cells = []
                for fn, nbytes in cases:
                    seconds = time_fn(fn, min_seconds=args.seconds)
                    cells.append(f"{seconds * 1e3:9.3f} {nbytes / seconds / 1e9:6.1f}GB/s")
                print(f"{layer:<8} {f'{N} x {K}':>12} {T:>4} {str(dtype)[6:]:<9} "
                      + " ".join(f"{c:>19}" for c in cells), flush=True)


def model_linears(model: str, tokens: list[int], seconds: float) -> None:
    """--model: each distinct stored linear of ``model`` against its float32 weights."""
    from orca_ext.model import load_model
    from orca_ext.model.quantized import QuantizedLinear
    from orca_ext.quantize import dequantize_weight

    linears: dict[tuple[str, int, int, str], tuple[str, torch.Tensor]] = {}
    for name, module in load_model(model).model.named_modules():
        if isinstance(module, QuantizedLinear):
            key = (module.format, module.weight.shape[0], module.in_features, module.activation)
            linears.setdefault(key, (name, module.weight))
    print(f"{'linear':<22} {'format':<6} {'N x K':>12} {'T':>4} {'packed_linear f32':>20} "
          f"{'quantized_linear':>20}   (ms, GFLOP/s)")
    gen = torch.Generator().manual_seed(0)
    for (fmt, N, K, act), (name, q) in linears.items():
        w = dequantize_weight(q, fmt, K)
        for T in tokens:
            x = torch.randn(T, K, generator=gen)
            cells = []
            int8 = name != "lm_head"
            for fn in (lambda: ops.packed_linear(x, w, None, act),
                       lambda: ops.quantized_linear(x, q, fmt, K, None, act,
                                                    int8_activations=int8)):
                t = time_fn(fn, min_seconds=seconds)
                cells.append(f"{t * 1e3:9.3f} {2 * T * N * K / t / 1e9:7.1f}")
            print(f"{name:<22} {fmt:<6} {f'{N} x {K}':>12} {T:>4} "
                  + " ".join(f"{c:>20}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
