"""Decode-step time of a model against its memory-bandwidth bound, measured in the same run.

    python bench/model.py [--model orca-tiny] [--dtype float32] [--quantization none] [--device cpu]
                          [--batch-sizes 1 4 8 32] [--context 128] [--threads N] [--rounds 7]

A decode step reads every weight once, so it cannot beat ``weight bytes / copy bandwidth``
(the bandwidth of a large tensor copy, counting bytes read + written). The copy is timed
alternately with the steps (``--rounds``): a shared machine's memory bandwidth drifts by tens
of percent from minute to minute. ``read GB/s`` is the weight bytes over the step time; ``+KV x``
is the step against a bound that also counts the KV cache the step's attention reads. ``scan
GB/s`` is a read-only pass (a sum) over the copy's source, timed in the same alternation, and
``x scan`` the step against weights + KV over it: how close the step comes to reading its bytes
as fast as this machine reads a large buffer (a copy's read + write traffic can exceed that).
Target: a decode step (ModelRunner.execute: metadata, forward, lm_head, greedy sampling)
within 1.5x that bound at batch 1-4. Embedding tables count only when read whole (a tied lm_head).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_fn  # noqa: E402

from orca_ext.batch import NewRequestData, ScheduledRequest, SchedulerOutput  # noqa: E402
from orca_ext.kv import KVCache, SlotAllocator, kv_bytes_per_block, num_kv_blocks  # noqa: E402
from orca_ext.model import load_model  # noqa: E402
from orca_ext.model.arena import huge_page_empty  # noqa: E402
from orca_ext.model.layers import Embedding  # noqa: E402
from orca_ext.runner import ModelRunner  # noqa: E402
from orca_ext.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)


class CopyBandwidth:
    """Bytes per second moved (read + written) by a large tensor copy; on CPU between huge-page
    buffers, as the model's weights are (orca_ext/model/arena.py)."""

    def __init__(self, device: str, nbytes: int = 512 * 2 ** 20) -> None:
        if device == "cpu":
            self.src, self.dst = (huge_page_empty(nbytes).view(torch.float32) for _ in range(2))
            self.src.fill_(1.0)
        else:
            self.src = torch.ones(nbytes // 4, device=device)
            self.dst = torch.empty_like(self.src)
        self.device, self.nbytes = device, nbytes

    def measure(self) -> float:
        return 2 * self.nbytes / time_fn(lambda: self.dst.copy_(self.src), self.device,
                                         warmup=1, min_runs=3, min_seconds=0.1)

    def measure_scan(self) -> float:
        """Bytes per second read by a sum over the source buffer (nothing written)."""
        return self.nbytes / time_fn(lambda: self.src.sum(), self.device, warmup=1, min_runs=3,
                                     min_seconds=0.1)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: all of them, except embedding tables, which
    are read by row unless one is also the lm_head."""
    lm_head = model.lm_head.weight
    row_read = {id(m.weight) for m in model.modules()
                if isinstance(m, Embedding) and m.weight is not lm_head}
    return sum(p.nbytes for p in model.parameters() if id(p) not in row_read)


def decode_step_and_bound(runner: ModelRunner, allocator: SlotAllocator, copy: CopyBandwidth,
                          batch: int, context: int, base_id: int, device: str,
                          rounds: int) -> tuple[float, float, float]:
    """Prefill ``batch`` requests of ``context`` tokens; then, alternately, time decode steps
    over them, the copy and the scan, ``rounds`` times, so all see the same state of a shared
    machine's memory system. Returns the median step seconds, copy and scan bandwidths."""
    vocab = runner.model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, context)).tolist()
    ids = [base_id + i for i in range(batch)]
    for rid in ids:
        allocator.allocate(rid, context + 1)
    runner.execute(SchedulerOutput(
        0, [ScheduledRequest(rid, prompt, 0, allocator.blocks(rid))
            for rid, prompt in zip(ids, prompts)],
        [NewRequestData(rid, context, GREEDY) for rid in ids]))
    # Decode at a fixed context (re-writing the same slot each step), so every step is alike.
    step = SchedulerOutput(1, [ScheduledRequest(rid, [1], context) for rid in ids])
    steps, bandwidths, scans = [], [], []
    for _ in range(rounds):
        with torch.inference_mode():  # entered once, as the engine loops do
            steps.append(time_fn(lambda: runner.execute(step), device, warmup=10, min_runs=20,
                                 min_seconds=0.3))
        bandwidths.append(copy.measure())
        scans.append(copy.measure_scan())
    runner.execute(SchedulerOutput(2, [], finished_request_ids=ids))
    for rid in ids:
        allocator.free(rid)
    return statistics.median(steps), statistics.median(bandwidths), statistics.median(scans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="orca-tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None,
                        help="none, q8_0, q4_0, q4_1 (default: a GGUF's stored formats)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--context", type=int, default=128, help="tokens per request")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="alternations of step and copy timing per batch size")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device,
                        quantization=args.quantization)
    max_batch = max(args.batch_sizes)
    tokens = max_batch * (args.context + BLOCK_SIZE)
    blocks = num_kv_blocks(loaded.config, BLOCK_SIZE, loaded.dtype, kv_cache_tokens=tokens)
    allocator = SlotAllocator(blocks, BLOCK_SIZE)
    runner = ModelRunner(loaded.model, KVCache(loaded.config, blocks, BLOCK_SIZE, loaded.dtype,
                                               args.device))
    copy = CopyBandwidth(args.device)
    weights = weight_bytes_per_step(loaded.model)
    print(f"model {args.model} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads): "
          f"{weights / 1e6:.1f} MB of weights read per decode step; bound = weight bytes / copy "
          f"bandwidth (read + written), measured alternately with the steps")
    kv_per_token = kv_bytes_per_block(loaded.config, BLOCK_SIZE, loaded.dtype) // BLOCK_SIZE
    print(f"{'batch':>5} {'context':>7} {'step ms':>9} {'copy GB/s':>10} {'bound ms':>9} "
          f"{'x bound':>8} {'+KV x':>7} {'read GB/s':>10} {'scan GB/s':>10} {'x scan':>7} "
          f"{'tokens/s':>9}")
    for i, batch in enumerate(args.batch_sizes):
        seconds, bandwidth, scan = decode_step_and_bound(runner, allocator, copy, batch,
                                                         args.context, 1000 * i, args.device,
                                                         args.rounds)
        bound = weights / bandwidth
        step_bytes = weights + batch * (args.context + 1) * kv_per_token
        target = "  (target <= 1.50)" if batch <= 4 else ""
        print(f"{batch:>5} {args.context:>7} {seconds * 1e3:>9.3f} {bandwidth / 1e9:>10.2f} "
              f"{bound * 1e3:>9.3f} {seconds / bound:>8.2f} "
              f"{seconds / (step_bytes / bandwidth):>7.2f} {weights / seconds / 1e9:>10.1f} "
              f"{scan / 1e9:>10.1f} {seconds / (step_bytes / scan):>7.2f} "
              f"{batch / seconds:>9.0f}{target}")


if __name__ == "__main__":
    main()
