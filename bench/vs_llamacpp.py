"""Ours against llama.cpp on the same GGUF weights and the same threads, in one run.

    pip install llama-cpp-python==0.3.36   # builds llama.cpp with -march=native (~7 min, 2 cores)
    python bench/vs_llamacpp.py [--model smollm2-135m-instruct] [--requantize q4_k_m] [--threads 2]
        [--sections load one_stream offline] [--llamacpp-files stored q8_0 f32] [--extra-bufts]
        [--prompt-tokens 512] [--decode-tokens 128] [--repeats 3]
        [--num-requests 32] [--ours-batch-sizes 32] [--llamacpp-batch-sizes 16] [--json FILE]
        [--plot PNG ...]

Engines:
- ours on the file's stored formats (quantized linears and head) with float32 activations (the
  engine's default for a GGUF) and with bfloat16 activations, and on its weights dequantized to
  bfloat16 (``quantization="none"``);
- llama.cpp, through llama-cpp-python's C API, on the file as shipped and on ``q8_0`` / ``f32``
  copies of it written by llama.cpp's own ``llama_model_quantize`` (cached in ``--work-dir``).
  Its model loads with ``use_extra_bufts = False`` unless ``--extra-bufts``: on an AMX VM
  llama.cpp's AMX repacking of Q4_1 died with "Illegal instruction", so its CPU
  kernels run on the stored blocks.

Sections:
- ``load``: seconds from the load call to the first token of a 3-token prompt, in a fresh
  process (Python imports excluded; the file in the page cache: the best of ``--repeats`` after
  one untimed load), and the process's resident growth over it; ours is ``LLM(file)``, llama.cpp
  ``llama_model_load_from_file`` (its default mmap) + a context; with our weights' bytes against
  the file's tensor bytes.
- ``one_stream``: prefill tok/s of one prompt of ``--prompt-tokens`` random token ids, then greedy
  decode tok/s over ``--decode-tokens`` tokens (EOS off); the best of ``--repeats``.
- ``offline``: Orca's workload (bench/serving.py's: prompts ~U[32, 512], outputs ~U[1, 128],
  random token ids, greedy, EOS off, ``--num-requests`` requests all present at once). Ours is
  ``LLM.generate`` with ``max_batch_size`` B. llama.cpp batches the way its server does: one
  sequence per request, up to B at once, each iteration one ``llama_batch`` holding every running
  sequence's next token and then as many waiting prompt tokens as ``--llamacpp-n-batch`` leaves
  room for, one unified KV cache, a finished sequence's cells removed
  (``llama_memory_seq_rm``) and its sequence id given to the next request. Reported: seconds,
  output tok/s, each engine's share of greedy outputs equal to llama.cpp's on the stored file,
  and ours' best over llama.cpp's best.
``--plot`` draws each section's tokens/s per engine into PNG files (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import serving  # noqa: E402

from orca_ext import LLM, SamplingParams  # noqa: E402
from orca_ext.model import load_model  # noqa: E402
from orca_ext.model.loader import load_model_info, resolve_model_path  # noqa: E402

# Our settings: (row name, load_model keywords).
OURS = {
    "stored_f32": ("ours, stored formats, float32 activations",
                   dict(dtype="float32")),
    "stored_bf16": ("ours, stored formats, bfloat16 activations",
                    dict(dtype="bfloat16")),
    "bf16": ("ours, dequantized bfloat16", dict(dtype="bfloat16", quantization="none")),
}
# llama.cpp's files: the one shipped, and copies written by llama_model_quantize (its ftype).
LLAMACPP_FTYPES = {"q8_0": 7, "f32": 0, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def ours_one_stream(model: str, prompt: list[int], decode_tokens: int, repeats: int,
                    **load: object) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one request through LLM, the best of ``repeats`` after
    one warm-up request (decode: the request's time less its prefill's), without the prefix
    cache, which would serve every pass's prompt from the first."""
    llm = LLM(load_model(model, **load), max_batch_size=1,
              kv_cache_tokens=len(prompt) + decode_tokens + 16,
              enable_prefix_caching=False)  # each pass computes the prompt again
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


def ours_offline(model: str, requests: Sequence[serving.WorkloadRequest], batch_size: int,
                 **load: object) -> tuple[float, list[list[int]]]:
    """(seconds, outputs) of one ``LLM.generate`` of every request, after a warm-up."""
    longest = max(r.prompt_len + r.output_len for r in requests)
    llm = LLM(load_model(model, **load), max_batch_size=batch_size,
              kv_cache_tokens=batch_size * longest,
              enable_prefix_caching=False)  # the warm-up's prompts would serve the first two
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([r.prompt[:32] for r in requests[:2]], warm, use_tqdm=False)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


# The timed part of one load, run in a fresh process: argv is (file, threads); prints
# [seconds, resident growth in bytes].
_RESIDENT = "int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')"
LOAD_CHILDREN = {
    "ours": f"""
import json, os, sys, time
import gguf, tokenizers, torch  # imported before the clock starts, as orca_ext is
from orca_ext import LLM, SamplingParams
# The modules LLM(file) imports on first use: the target excludes Python imports.
import orca_ext.build, orca_ext.distributed.executor, orca_ext.kv.cache, orca_ext.model.loader
import orca_ext.model.gguf_reader, orca_ext.model.gguf_tokenizer, orca_ext.runner.model_runner
import orca_ext.sampling
torch.set_num_threads(int(sys.argv[2]))
resident, start = {_RESIDENT}, time.perf_counter()
llm = LLM(sys.argv[1], max_batch_size=1, kv_cache_tokens=64)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
print(json.dumps([time.perf_counter() - start, {_RESIDENT} - resident]))
""",
    "llama.cpp": f"""
import json, logging, os, sys, time
import llama_cpp as lc
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
lc.llama_backend_init()
resident, start = {_RESIDENT}, time.perf_counter()
model_params = lc.llama_model_default_params()
model_params.use_extra_bufts = sys.argv[3] == "1"
model = lc.llama_model_load_from_file(sys.argv[1].encode(), model_params)
params = lc.llama_context_default_params()
params.n_ctx = 64
params.n_threads = params.n_threads_batch = int(sys.argv[2])
ctx = lc.llama_init_from_model(model, params)
tokens = (lc.llama_token * 3)(1, 2, 3)
assert lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, 3)) == 0
lc.llama_get_logits_ith(ctx, -1)
print(json.dumps([time.perf_counter() - start, {_RESIDENT} - resident]))
""",
}


def load_time(engine: str, path: str, threads: int, repeats: int,
              extra_bufts: bool) -> tuple[float, float]:
    """(seconds, resident MB) of the fastest of ``repeats`` loads after an untimed one."""
    runs = []
    for _ in range(1 + repeats):
        done = subprocess.run([sys.executable, "-c", LOAD_CHILDREN[engine], path, str(threads),
                               str(int(extra_bufts))], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{engine} could not load {path} (exit code {done.returncode}): "
                               f"{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    seconds, resident = min(runs[1:])
    return seconds, resident / 1e6


def weight_bytes(path: str) -> tuple[int, int]:
    """(bytes of our loaded model's parameters, bytes of the file's tensors)."""
    from orca_ext.model.gguf import GGUFFile

    model = load_model(path).model
    ours = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return ours, sum(int(t.data.nbytes) for t in GGUFFile(path).tensors.values())


@dataclass
class _Sequence:
    """One request in llama.cpp's batch: its sequence id and how far it has got."""

    index: int
    seq_id: int
    prompt: list[int]
    output_len: int
    pos: int = 0  # tokens already in the KV cache
    next_token: int = -1
    output: list[int] = field(default_factory=list)


class LlamaCpp:
    """One llama.cpp model, loaded once, through llama-cpp-python's C API."""

    def __init__(self, path: str, threads: int, extra_bufts: bool) -> None:
        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load and graph logs
        self.lc = llama_cpp
        self.threads = threads
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.lc.llama_model_free(self.model)

    def _context(self, n_ctx: int, n_seq: int, n_batch: int, n_ubatch: int):
        params = self.lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, n_seq, True
        params.n_batch, params.n_ubatch = n_batch, n_ubatch
        params.n_threads = params.n_threads_batch = self.threads
        ctx = self.lc.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} cells")
        return ctx

    def _argmax(self, ctx, row: int) -> int:
        logits = self.lc.llama_get_logits_ith(ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def one_stream(self, prompt: list[int], decode_tokens: int,
                   repeats: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one sequence in a fresh context per pass, the best
        of ``repeats`` after one warm-up pass."""
        lc, results = self.lc, []
        for _ in range(1 + repeats):
            ctx = self._context(len(prompt) + decode_tokens + 16, 1, len(prompt), len(prompt))
            tokens = (lc.llama_token * len(prompt))(*prompt)
            start = time.perf_counter()
            if lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, len(prompt))) != 0:
                raise RuntimeError("llama_decode failed on the prompt")
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(decode_tokens):
                step = (lc.llama_token * 1)(self._argmax(ctx, -1))
                if lc.llama_decode(ctx, lc.llama_batch_get_one(step, 1)) != 0:
                    raise RuntimeError("llama_decode failed on a decode step")
            decode = time.perf_counter() - start
            lc.llama_free(ctx)
            results.append((len(prompt) / prefill, decode_tokens / decode))
        return max(r[0] for r in results[1:]), max(r[1] for r in results[1:])

    def offline(self, requests: Sequence[serving.WorkloadRequest], batch_size: int,
                n_batch: int, n_ubatch: int) -> tuple[float, list[list[int]]]:
        """(seconds, outputs) of every request through server-style continuous batching (the
        module docstring), after a warm-up sequence."""
        lc = self.lc
        longest = max(r.prompt_len + r.output_len for r in requests)
        ctx = self._context(batch_size * longest, batch_size, n_batch, n_ubatch)
        memory = lc.llama_get_memory(ctx)
        batch = lc.llama_batch_init(n_batch, 0, 1)
        tokens = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
        positions = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
        wants_logits = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n_batch,))[:] = 1
        seq_slots = [batch.seq_id[i] for i in range(n_batch)]

        def decode(sequences: list[_Sequence]) -> tuple[float, list[list[int]]]:
            waiting, running = deque(sequences), []
            free_ids = list(range(batch_size))[::-1]
            start = time.perf_counter()
            while waiting or running:
                while free_ids and waiting:
                    seq = waiting.popleft()
                    seq.seq_id = free_ids.pop()
                    running.append(seq)
                n, sampled = 0, []
                for seq in running:  # every running decode's next token first
                    if seq.output and seq.pos == len(seq.prompt) + len(seq.output) - 1:
                        tokens[n], positions[n], wants_logits[n] = seq.next_token, seq.pos, 1
                        seq_slots[n][0] = seq.seq_id
                        sampled.append((seq, n))
                        seq.pos, n = seq.pos + 1, n + 1
                for seq in running:  # then waiting prompt tokens, as many as fit
                    if seq.pos >= len(seq.prompt) or n == n_batch:
                        continue
                    take = min(len(seq.prompt) - seq.pos, n_batch - n)
                    tokens[n:n + take] = seq.prompt[seq.pos:seq.pos + take]
                    positions[n:n + take] = np.arange(seq.pos, seq.pos + take)
                    wants_logits[n:n + take] = 0
                    for row in range(n, n + take):
                        seq_slots[row][0] = seq.seq_id
                    seq.pos, n = seq.pos + take, n + take
                    if seq.pos == len(seq.prompt):
                        wants_logits[n - 1] = 1
                        sampled.append((seq, n - 1))
                batch.n_tokens = n
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError(f"llama_decode failed on a batch of {n} tokens")
                for seq, row in sampled:
                    seq.next_token = self._argmax(ctx, row)
                    seq.output.append(seq.next_token)
                    if len(seq.output) == seq.output_len:
                        lc.llama_memory_seq_rm(memory, seq.seq_id, -1, -1)
                        free_ids.append(seq.seq_id)
                        running.remove(seq)
            return time.perf_counter() - start, [s.output for s in sequences]

        try:
            decode([_Sequence(0, -1, list(requests[0].prompt[:32]), 4)])
            return decode([_Sequence(r.index, -1, list(r.prompt), r.output_len)
                           for r in requests])
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)


def llamacpp_file(source: str, kind: str, work_dir: Path, threads: int) -> str:
    """The GGUF llama.cpp runs for ``kind``: the shipped file, or a copy that its
    ``llama_model_quantize`` writes once (requantizing the shipped blocks)."""
    if kind == "stored":
        return source
    import llama_cpp

    target = work_dir / f"{Path(source).stem}.{kind}.gguf"
    if not target.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = (
            LLAMACPP_FTYPES[kind], True, threads)
        print(f"writing {target} with llama_model_quantize", flush=True)
        if llama_cpp.llama_model_quantize(source.encode(), str(target).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize could not write {target}")
    return str(target)


def agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]]) -> str:
    """Share of requests whose greedy outputs are identical, and the mean share of each output
    before the first differing token (numerics apart, outputs diverge late, not at once)."""
    same = sum(a == b for a, b in zip(ours, theirs)) / max(len(ours), 1)
    prefix = []
    for a, b in zip(ours, theirs):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(common / max(len(a), 1))
    return f"{same:.0%} ({np.mean(prefix):.0%})"


def plot(record: dict, title: str, paths: Sequence[Path]) -> None:
    """Horizontal bars of tokens/s per engine: one stream's prefill and decode, offline output
    (the sections the record has); ours blue, llama.cpp orange."""
    plt = common.pyplot(paths)
    if plt is None:
        return
    panels = []
    if "one_stream" in record:
        rows = record["one_stream"]
        panels += [("one stream: prefill tok/s", {n: r[0] for n, r in rows.items()}),
                   ("one stream: decode tok/s", {n: r[1] for n, r in rows.items()})]
    if "offline" in record:
        panels.append(("offline: output tok/s", {n: r["output_tokens_per_s"]
                                                 for n, r in record["offline"].items()}))
    height = max(len(values) for _, values in panels) * 0.35 + 1.0
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, height * len(panels)), squeeze=False)
    for ax, (name, values) in zip(axes[:, 0], panels):
        names = list(values)[::-1]  # the first engine on top
        colors = ["tab:orange" if n.startswith("llama.cpp") else "tab:blue" for n in names]
        bars = ax.barh(names, [values[n] for n in names], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
        ax.set_title(name, fontsize=9, loc="left")
        ax.tick_params(axis="y", labelsize=8)
        ax.margins(x=0.12)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    common.save_figure(fig, paths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requantize", choices=tuple(LLAMACPP_FTYPES), default=None,
                        help="run every engine on the model's file re-quantized to this by "
                             "llama.cpp's llama_model_quantize (its K-quant mixes included)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", nargs="+", choices=("load", "one_stream", "offline"),
                        default=["load", "one_stream", "offline"])
    parser.add_argument("--ours", nargs="*", choices=tuple(OURS), default=list(OURS))
    parser.add_argument("--llamacpp-files", nargs="+", choices=("stored", *LLAMACPP_FTYPES),
                        default=["stored", *LLAMACPP_FTYPES])
    parser.add_argument("--work-dir", default="bench/results/llamacpp",
                        help="where the q8_0 / f32 copies are written once")
    parser.add_argument("--extra-bufts", action="store_true",
                        help="let llama.cpp repack weights into its extra buffer types (AMX)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="one_stream: timed passes per engine, the best reported")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--ours-batch-sizes", type=int, nargs="+", default=[32])
    parser.add_argument("--llamacpp-batch-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--llamacpp-n-batch", type=int, default=2048,
                        help="offline: tokens per llama_batch (its server's default)")
    parser.add_argument("--llamacpp-n-ubatch", type=int, default=512,
                        help="offline: tokens per llama.cpp compute pass (its server's default)")
    serving.add_workload_args(parser)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", nargs="+", default=[], metavar="PNG",
                        help="draw tokens/s per engine into these files")
    args = parser.parse_args()
    for name in ("ours_batch_sizes", "llamacpp_batch_sizes"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    if args.requantize:
        path = llamacpp_file(path, args.requantize, Path(args.work_dir), args.threads)
    vocab = load_model_info(args.model).config.vocab_size
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")
    files = {kind: llamacpp_file(path, kind, Path(args.work_dir), args.threads)
             for kind in args.llamacpp_files}
    print(f"{path}\n{cpu}, {args.threads} threads; llama.cpp use_extra_bufts = "
          f"{args.extra_bufts}; llama.cpp files: "
          + ", ".join(f"{k} {Path(f).stat().st_size / 1e6:.1f} MB" for k, f in files.items()),
          flush=True)
    record: dict = {"cpu": cpu, "threads": args.threads, "args": vars(args)}

    if "load" in args.sections:
        loads = {name: load_time(name, path, args.threads, args.repeats, args.extra_bufts)
                 for name in LOAD_CHILDREN}
        print("\nload: the call to the first token, a fresh process, file cached")
        for name, (seconds, resident) in loads.items():
            print(f"{name:<12} {seconds:6.2f} s, resident growth {resident:7.1f} MB")
        ours_bytes, file_bytes = weight_bytes(path)
        print(f"ours / llama.cpp load time: {loads['ours'][0] / loads['llama.cpp'][0]:.2f}x; "
              f"our weights {ours_bytes / 1e6:.1f} MB = {ours_bytes / file_bytes:.3f}x the "
              f"file's tensor bytes ({file_bytes / 1e6:.1f} MB)")
        record["load"] = {"seconds": {n: s for n, (s, _) in loads.items()},
                          "resident_mb": {n: r for n, (_, r) in loads.items()},
                          "weight_bytes": ours_bytes, "file_tensor_bytes": file_bytes}

    if "one_stream" in args.sections:
        rng = np.random.default_rng(0)
        prompt = rng.integers(100, vocab, args.prompt_tokens).tolist()
        rows = {}
        for key in args.ours:
            name, load = OURS[key]
            rows[name] = ours_one_stream(path, prompt, args.decode_tokens, args.repeats, **load)
        for kind, file in files.items():
            engine = LlamaCpp(file, args.threads, args.extra_bufts)
            rows[f"llama.cpp, {kind} file"] = engine.one_stream(prompt, args.decode_tokens,
                                                                 args.repeats)
            engine.close()
        print(f"\none stream: prompt {args.prompt_tokens} tokens, decode {args.decode_tokens}")
        print(f"{'engine':<46} {'prefill tok/s':>14} {'decode tok/s':>13}")
        for name, (prefill, decode) in rows.items():
            print(f"{name:<46} {prefill:14.1f} {decode:13.1f}")
        record["one_stream"] = rows
        best_cpp = max((r for n, r in rows.items() if n.startswith("llama.cpp")),
                       key=lambda r: r[1], default=None)
        stored = rows.get(OURS["stored_f32"][0])
        if best_cpp and stored:
            print(f"ours stored (float32 activations) / llama.cpp's best decode: "
                  f"{stored[1] / best_cpp[1]:.2f}x; prefill {stored[0] / best_cpp[0]:.2f}x")
        if "llama.cpp, stored file" in rows and stored:
            cpp = rows["llama.cpp, stored file"]
            print(f"ours stored / llama.cpp on the same file: decode {stored[1] / cpp[1]:.2f}x, "
                  f"prefill {stored[0] / cpp[0]:.2f}x")
        if OURS["bf16"][0] in rows:
            bf16 = rows[OURS["bf16"][0]]
            for key in ("stored_f32", "stored_bf16"):
                if OURS[key][0] in rows:
                    print(f"{OURS[key][0]} / ours bfloat16: decode "
                          f"{rows[OURS[key][0]][1] / bf16[1]:.2f}x")

    if "offline" in args.sections:
        spec = serving.WorkloadSpec(kind=args.workload, prompt_len=tuple(args.prompt_len),
                                    output_len=tuple(args.output_len), vocab_size=vocab,
                                    special_ids=tuple(range(100)))
        requests = serving.make_requests(spec, args.num_requests, float("inf"), args.seed)
        output_tokens = sum(r.output_len for r in requests)
        runs: dict[str, tuple[float, list[list[int]]]] = {}

        def record_run(name: str, result: tuple[float, list[list[int]]]) -> None:
            runs[name] = result
            print(f"  {name}: {result[0]:.1f} s", flush=True)

        for kind, file in files.items():
            engine = LlamaCpp(file, args.threads, args.extra_bufts)
            for b in args.llamacpp_batch_sizes:
                record_run(f"llama.cpp, {kind} file, B = {b}", engine.offline(
                    requests, b, args.llamacpp_n_batch, args.llamacpp_n_ubatch))
            engine.close()
        for key in args.ours:
            name, load = OURS[key]
            for b in args.ours_batch_sizes:
                record_run(f"{name}, B = {b}", ours_offline(path, requests, b, **load))
        reference = next((out for n, (_, out) in runs.items()
                          if n.startswith("llama.cpp, stored file")), None)
        print(f"\noffline: {len(requests)} requests, prompts ~U{tuple(args.prompt_len)}, outputs "
              f"~U{tuple(args.output_len)}, {output_tokens} output tokens, all at once, greedy")
        print("(= llama.cpp stored: the share of outputs equal to llama.cpp's on the stored file, "
              "and of tokens before the first difference)")
        print(f"{'engine':<58} {'seconds':>8} {'out tok/s':>10} {'= llama.cpp stored':>19}")
        for name, (seconds, outputs) in runs.items():
            same = "-" if reference is None else agreement(outputs, reference)
            print(f"{name:<58} {seconds:8.1f} {output_tokens / seconds:10.1f} {same:>19}")
        ours_best = min((n for n in runs if n.startswith("ours")), key=lambda n: runs[n][0],
                        default=None)
        cpp_best = min((n for n in runs if n.startswith("llama.cpp")),
                       key=lambda n: runs[n][0], default=None)
        if ours_best and cpp_best:
            print(f"ours' best ({ours_best}) / llama.cpp's best ({cpp_best}): "
                  f"{runs[cpp_best][0] / runs[ours_best][0]:.2f}x; their greedy outputs equal: "
                  f"{agreement(runs[ours_best][1], runs[cpp_best][1])}")
        record["offline"] = {n: {"seconds": s, "output_tokens_per_s": output_tokens / s}
                             for n, (s, _) in runs.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    if args.plot:
        plot(record, f"{Path(path).name}: ours against llama.cpp; {cpu}, {args.threads} threads, "
             f"{time.strftime('%Y-%m-%d')}", [Path(p) for p in args.plot])
    return 0


if __name__ == "__main__":
    sys.exit(main())
