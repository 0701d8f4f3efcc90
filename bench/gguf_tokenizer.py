"""How long a GGUF file's metadata and tokenizer take to load, part of every model load: ours
(``GGUFFile``, then ``gguf_tokenizer``) against gguf's own ``GGUFReader`` and transformers'
``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, on the built-in files.

    python bench/gguf_tokenizer.py [--models gemma-3-270m smollm2-135m-instruct] [--runs 3]

Each figure is the best of ``--runs`` (wall seconds, and the process's CPU seconds beside it,
which a busy machine inflates less).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from orca_ext.model.builtin import builtin_gguf_path
from orca_ext.model.gguf import GGUFFile
from orca_ext.model.gguf_tokenizer import gguf_tokenizer


def best(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """The shortest (wall, CPU) seconds of ``runs`` calls."""
    times = []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gemma-3-270m", "smollm2-135m-instruct"])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    for name in args.models:
        path = builtin_gguf_path(name)
        file = GGUFFile(path)
        figures = {
            "GGUFFile (metadata, tensor index)": best(lambda: GGUFFile(path), args.runs),
            "gguf_tokenizer": best(lambda: gguf_tokenizer(file), args.runs),
            "gguf.GGUFReader alone": best(lambda: GGUFReader(path), args.runs),
            "transformers AutoTokenizer": best(lambda: AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name), args.runs),
        }
        vocab = len(file.value("tokenizer.ggml.tokens"))
        print(f"{name} ({vocab} tokens)")
        for label, (wall, cpu) in figures.items():
            print(f"  {label:<36} {wall:6.2f} s  (CPU {cpu:5.2f} s)")


if __name__ == "__main__":
    main()
