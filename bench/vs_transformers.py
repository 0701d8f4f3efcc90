"""Offline throughput against Hugging Face ``transformers`` on the same weights and workload.

    python bench/vs_transformers.py [--model smollm2-135m-instruct] [--num-requests 64]
        [--max-batch-size 32] [--hf-batch-sizes 4 8 16 32] [--hf-cb-batch-sizes 4 8 16]
        [--workload orca|sharegpt] [--dtype auto|float32|bfloat16] [--seed 0] [--json FILE]

The model (default: the built-in ``smollm2-135m-instruct``) is saved with
``save_pretrained_folder`` and loaded back by ``transformers.AutoModelForCausalLM``, so both sides
run the same weights, in the same dtype (``--dtype``, default auto: bfloat16 where the CPU has
AMX or AVX512-BF16, else float32) on the same threads. The workload is
bench/serving.py's (Orca's synthetic one by default), every request present at once, greedy,
ignoring EOS, each with its own output length.

- ours: ``LLM.generate`` (iteration-level scheduling, selective batching).
- transformers static batching: ``model.generate`` over consecutive chunks of ``b`` requests in
  arrival order, left-padded, ``max_new_tokens`` = the chunk's longest output and
  ``min_new_tokens`` equal to it (so EOS never ends a row). Only each request's own output
  length counts as useful tokens: the rest is the waste of request-level batching.
- transformers continuous batching (``ContinuousBatchingManager``, transformers 5.x), when the
  installed version has it: every request added with its own ``max_new_tokens`` and EOS off,
  ``max_requests_per_batch`` = ``b``.
Throughput is useful output tokens per second. The host's speed drifts over minutes (other
tenants), so ours runs again right after each transformers configuration and each ratio is
taken against that adjacent run; the summary is ours over transformers' best ``b``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402


def ours_runner(loaded: Any, requests: Sequence[serving.WorkloadRequest], max_batch_size: int,
                kv_cache_tokens: int) -> Callable[[], tuple[float, list[list[int]]]]:
    """An ``LLM`` over ``loaded``, warmed up; the returned function times one ``generate`` of
    all ``requests`` and returns (seconds, outputs)."""
    from orca_ext.llm import LLM
    from orca_ext.sampling_params import SamplingParams

    # No prefix cache: each run sends the same prompts again, which it would serve.
    llm = LLM(loaded, max_batch_size=max_batch_size, kv_cache_tokens=kv_cache_tokens,
              enable_prefix_caching=False)
    warm = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 2
    llm.generate([r.prompt[:32] for r in requests[:2]], warm, use_tqdm=False)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
              for r in requests]

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    return run


@torch.inference_mode()
def run_hf_static(model: Any, requests: Sequence[serving.WorkloadRequest], batch_size: int,
                  pad_id: int) -> tuple[float, int, list[list[int]]]:
    """Padded request-level batches; returns (seconds, tokens generated incl. waste, outputs)."""
    outputs: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i:i + batch_size]
        width = max(r.prompt_len for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):  # left padding
            ids[row, width - r.prompt_len:] = torch.tensor(r.prompt)
            mask[row, width - r.prompt_len:] = 1
        new = max(r.output_len for r in chunk)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
        generated += (out.shape[1] - width) * len(chunk)
        outputs += [out[row, width:width + r.output_len].tolist() for row, r in enumerate(chunk)]
    return time.perf_counter() - start, generated, outputs


@torch.inference_mode()
def run_hf_continuous(model: Any, requests: Sequence[serving.WorkloadRequest], batch_size: int,
                      max_batch_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(r.prompt_len + r.output_len for r in requests)
    page = 64
    config = ContinuousBatchingConfig(
        page_size=page, max_requests_per_batch=batch_size, max_batch_tokens=max_batch_tokens,
        num_blocks=batch_size * -(-longest // page) + 4)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1,
                                  max_new_tokens=max(r.output_len for r in requests))
    with model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=config,
            warmup=False) as manager:
        _wait_all(manager, [manager.add_request(requests[0].prompt[:16], request_id="warmup",
                                                max_new_tokens=2, eos_token_id=-1)])
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, request_id=f"r{r.index}",
                                   max_new_tokens=r.output_len, eos_token_id=-1)
               for r in requests]
        done = _wait_all(manager, ids)
        elapsed = time.perf_counter() - start
    return elapsed, [list(done[i].generated_tokens) for i in ids]


def _wait_all(manager: Any, ids: Sequence[str]) -> dict[str, Any]:
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=60)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
        elif result.is_finished():
            done[result.request_id] = result
    return done


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def has_continuous_batching(model: Any) -> bool:
    return hasattr(model, "continuous_batching_context_manager")


def agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]]) -> float:
    """Fraction of requests whose greedy outputs are identical (float32 ties aside)."""
    return sum(a == b for a, b in zip(ours, theirs)) / max(len(ours), 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[4, 8, 16, 32])
    parser.add_argument("--hf-cb-batch-sizes", type=int, nargs="*", default=[4, 8, 16],
                        help="max_requests_per_batch for transformers' continuous batching "
                        "(none: skip it)")
    parser.add_argument("--hf-cb-max-batch-tokens", type=int, default=2048)
    parser.add_argument("--hf-folder", default=None,
                        help="where to save the model for transformers (default: a temp dir)")
    parser.add_argument("--json", default=None)
    serving.add_workload_args(parser)
    serving.add_engine_args(parser)
    parser.set_defaults(max_batch_size=32, device="cpu")
    args = parser.parse_args(argv)

    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notices

    from orca_ext.model import save_pretrained_folder

    loaded = serving.load(args)
    spec = serving.spec_for_model(args, loaded)
    requests = serving.make_requests(spec, args.num_requests, float("inf"), args.seed)
    useful = sum(r.output_len for r in requests)
    prompt_tokens = sum(r.prompt_len for r in requests)
    print(f"{args.num_requests} requests ({args.workload}): {prompt_tokens} prompt tokens, "
          f"{useful} output tokens; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads", flush=True)

    run_ours = ours_runner(loaded, requests, args.max_batch_size,
                           serving.engine_kwargs(args, spec)["kv_cache_tokens"])

    def time_ours() -> tuple[float, float | None]:
        monitor = serving.OtherCpu()
        seconds, outputs = run_ours()
        if outputs != ours:
            print(f"WARNING: a repeat run of ours produced different tokens for "
                  f"{1 - agreement(ours, outputs):.0%} of the requests", flush=True)
        return seconds, monitor.cores()

    monitor = serving.OtherCpu()
    elapsed, ours = run_ours()
    label = f"ours (LLM.generate, max batch {args.max_batch_size})"
    print(f"{label:<44}{elapsed:8.2f} s {useful / elapsed:9.1f} tok/s  [others: "
          f"{_cores(monitor.cores())} cores]", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_pretrained_folder(loaded, args.hf_folder or tmp)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=loaded.dtype).eval()
    pad_id = loaded.info.eos_token_ids[0] if loaded.info.eos_token_ids else 0
    warm = dataclasses.replace(requests[0], prompt=requests[0].prompt[:16], prompt_len=16,
                               output_len=4)
    run_hf_static(model, [warm, warm], 2, pad_id)

    results: list[dict[str, Any]] = []

    def record(mode: str, b: int, seconds: float, theirs: list[list[int]], noise: float | None,
               label: str, note: str = "", **extra: Any) -> None:
        ours_seconds, ours_noise = time_ours()
        results.append({"mode": mode, "batch_size": b, "seconds": seconds,
                        "tokens_per_s": useful / seconds, "agreement": agreement(ours, theirs),
                        "other_cpu": noise, "ours_seconds": ours_seconds,
                        "ours_other_cpu": ours_noise, "ratio": seconds / ours_seconds, **extra})
        print(f"{label:<44}{seconds:8.2f} s {useful / seconds:9.1f} tok/s  [others: "
              f"{_cores(noise)} cores] ({agreement(ours, theirs):.0%} outputs equal ours{note})",
              flush=True)
        print(f"{'  then ours':<44}{ours_seconds:8.2f} s {useful / ours_seconds:9.1f} tok/s  "
              f"[others: {_cores(ours_noise)} cores] -> {seconds / ours_seconds:.2f}x", flush=True)

    for b in args.hf_batch_sizes:
        monitor = serving.OtherCpu()
        seconds, generated, theirs = run_hf_static(model, requests, b, pad_id)
        record("static", b, seconds, theirs, monitor.cores(),
               f"transformers generate(), batch {b}", f"; {generated - useful} wasted tokens",
               generated_tokens=generated)
    if args.hf_cb_batch_sizes and not has_continuous_batching(model):
        print(f"transformers {transformers.__version__} has no continuous batching: skipped")
    elif args.hf_cb_batch_sizes:
        for b in args.hf_cb_batch_sizes:
            monitor = serving.OtherCpu()
            try:
                seconds, theirs = run_hf_continuous(model, requests, b,
                                                    args.hf_cb_max_batch_tokens)
            except Exception as exc:  # noqa: BLE001  (report it, keep the static numbers)
                print(f"transformers continuous batching, batch {b}: failed: {exc!r}")
                results.append({"mode": "continuous", "batch_size": b, "error": repr(exc)})
                continue
            record("continuous", b, seconds, theirs, monitor.cores(),
                   f"transformers continuous batching, batch {b}")

    measured = [r for r in results if "tokens_per_s" in r]
    ours_runs = [elapsed] + [r["ours_seconds"] for r in measured]
    summary: dict[str, Any] = {"ours_seconds": ours_runs}
    print(f"ours over {len(ours_runs)} runs: {min(ours_runs):.2f}-{max(ours_runs):.2f} s")
    for mode in ("static", "continuous", None):
        mine = [r for r in measured if mode in (None, r["mode"])]
        if mine:
            best = max(mine, key=lambda r: r["tokens_per_s"])
            summary[f"best_{mode or 'overall'}"] = best
            name = f"transformers {mode}" if mode else "transformers' best"
            print(f"ours / {name} (best: {best['mode']} batch {best['batch_size']}, against ours "
                  f"run next to it): {best['ratio']:.2f}x")
    if args.json:
        serving.write_json(args.json, {
            "benchmark": "vs_transformers", "args": vars(args),
            "workload": dataclasses.asdict(spec), "environment": serving.environment(),
            "transformers": transformers.__version__, "num_output_tokens": useful,
            "num_prompt_tokens": prompt_tokens, "results": results, **summary})


if __name__ == "__main__":
    sys.exit(main())
