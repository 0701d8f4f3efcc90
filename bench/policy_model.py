"""A calibrated model of ``orca`` against ``request``: each policy simulated under
Poisson load on an iteration-cost model fitted on this machine, in the same run.

    python bench/policy_model.py [--quick] [--model orca-tiny] [--dtype float32] [--threads N]
        [--costs A,BD,BP,Q,C] [--max-batch-size 16] [--num-requests 2000] [--seeds 3]
        [--prompt-len 32 512] [--output-len 1 128] [--load-fractions 0.1 0.2 ...]
        [--warmup-fraction 0.1] [--latency-factors 1.5 2 3 5] [--cost-scales 1 0.5 ...]

1. Calibration: ``ModelRunner.execute`` is timed on decode iterations (``--decode-batches`` x
   ``--decode-contexts``), on one prompt of each of ``--prompt-lens``, and on each prompt with
   ``max_batch_size - 1`` decodes at the longest context. Seconds per iteration are fitted as
   ``a + bD*D + bP*P + q*sum(prompt^2) + c*C`` (D decode tokens, P prompt tokens, C the decodes'
   cached tokens), least squares on relative error, a negative coefficient fixed at 0.
   ``others``: the cores other processes used meanwhile (as in bench/serving.py); time on a
   quiet machine. ``--costs`` gives the five numbers (seconds) instead: no model is loaded.
2. Simulation of the engine's policies (bench/serving_sweep.py's setup: every request produces
   exactly its output length; the batch size binds, not memory). ``orca``: each iteration runs
   every running request's next token and admits waiting requests FCFS up to the batch size,
   each with its whole prompt (which yields its first token); a request returns at the end of
   the iteration of its last token. ``request``: an idle engine takes up to the batch size of
   waiting requests; the prompts run padded to the longest, then every row decodes until the
   longest output is done; all return together.
3. Per policy: saturation throughput (all requests at once), then rates ``--load-fractions`` x
   it; per rate the median and p90 normalized latency (latency / output tokens) without the
   earliest ``--warmup-fraction`` of arrivals, averaged over ``--seeds`` streams. Throughput
   under a latency limit as in bench/serving_sweep.py (its ``ratio_table``), on rates below the
   policy's saturation only.
4. Sensitivity: the per-token terms (bD, bP, q, c) scaled by ``--cost-scales``, ``a`` kept:
   how cheap a prefill must be, in decode steps, for ``orca`` / ``request`` to reach 4x.
Writes bench/results/policy_model.json (git-ignored).
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402
import serving_sweep  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("orca", "request")
BLOCK_SIZE = 16
QUICK = {"num_requests": 300, "seeds": 1, "load_fractions": [0.1, 0.3, 0.5, 0.7, 0.9, 1.05],
         "cost_scales": [1.0, 0.1], "min_seconds": 0.05}


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per iteration: a + b_decode*D + b_prefill*P + q*sum(prompt^2) + c*C."""

    a: float
    b_decode: float
    b_prefill: float
    q: float
    c: float

    def iteration(self, decode: int, prompt: int, prompt_sq: int, context: int) -> float:
        return (self.a + self.b_decode * decode + self.b_prefill * prompt + self.q * prompt_sq
                + self.c * context)

    def scaled(self, factor: float) -> Costs:
        return Costs(self.a, *(factor * x for x in dataclasses.astuple(self)[1:]))

    def prefill_in_decode_steps(self, prompt: float) -> float:
        """One prompt's iteration over a batch-1 decode step at that context."""
        return self.iteration(0, prompt, prompt * prompt, 0) / self.iteration(1, 0, 0, prompt)

    def __str__(self) -> str:
        return (f"a {self.a * 1e3:.3f} ms, b_decode {self.b_decode * 1e3:.4f} ms/token, "
                f"b_prefill {self.b_prefill * 1e3:.4f} ms/token, q {self.q * 1e9:.2f} ns/token^2,"
                f" c {self.c * 1e9:.2f} ns/context token")


def fit(features: np.ndarray, seconds: np.ndarray) -> Costs:
    """Least squares on relative error of ``seconds`` against [D, P, sum(prompt^2), C] rows; the
    most negative coefficient is fixed at 0 and the rest refitted until none is negative."""
    x = np.column_stack([np.ones(len(seconds)), features]) / seconds[:, None]
    free = list(range(5))
    while True:
        coef = np.zeros(5)
        coef[free] = np.linalg.lstsq(x[:, free], np.ones(len(seconds)), rcond=None)[0]
        if coef.min() >= 0:
            return Costs(*coef.tolist())
        free.remove(int(coef.argmin()))


def calibrate(args: argparse.Namespace) -> tuple[Costs, list[dict[str, Any]]]:
    """Time ``ModelRunner.execute`` on the calibration iterations; fit ``Costs`` to them."""
    import torch
    from common import time_fn

    from orca_ext.batch import NewRequestData, ScheduledRequest, SchedulerOutput
    from orca_ext.kv import KVCache, SlotAllocator, num_kv_blocks
    from orca_ext.model import load_model
    from orca_ext.runner import ModelRunner
    from orca_ext.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    context, batch = max(args.decode_contexts), args.max_batch_size
    per_request = max(context + 1, max(args.prompt_lens)) + BLOCK_SIZE
    rows = max(batch, *args.decode_batches) + 1
    blocks = num_kv_blocks(loaded.config, BLOCK_SIZE, loaded.dtype,
                           kv_cache_tokens=rows * per_request)
    allocator = SlotAllocator(blocks, BLOCK_SIZE)
    runner = ModelRunner(loaded.model, KVCache(loaded.config, blocks, BLOCK_SIZE, loaded.dtype))
    greedy = SamplingParams(temperature=0.0)
    # (prompt lengths, decode contexts) of each calibration iteration; the KV cache is zeroed,
    # so a decode needs no prefill first.
    shapes = ([([], [n] * b) for b in args.decode_batches for n in args.decode_contexts]
              + [([p], []) for p in args.prompt_lens]
              + [([p], [context] * (batch - 1)) for p in args.prompt_lens])
    points = []
    for prompts, contexts in shapes:
        requests, new = [], []
        for rid, p in enumerate(prompts):
            allocator.allocate(rid, p + 1)
            tokens = torch.randint(0, loaded.config.vocab_size, (p,)).tolist()
            requests.append(ScheduledRequest(rid, tokens, 0, allocator.blocks(rid)))
            new.append(NewRequestData(rid, p, greedy))
        for rid, n in enumerate(contexts, start=len(prompts)):
            allocator.allocate(rid, n + 1)
            requests.append(ScheduledRequest(rid, [1], n, allocator.blocks(rid)))
            new.append(NewRequestData(rid, n, greedy))
        ids = [r.request_id for r in requests]
        # The runner learns each request and its blocks once (an untimed run of the step); the
        # timed runs repeat the step without them.
        runner.execute(SchedulerOutput(0, requests, new))
        step = SchedulerOutput(1, [dataclasses.replace(r, new_block_ids=[]) for r in requests])
        monitor = serving.OtherCpu()
        seconds = time_fn(lambda: runner.execute(step), warmup=1, min_runs=3,
                          min_seconds=args.min_seconds)
        runner.execute(SchedulerOutput(2, [], finished_request_ids=ids))
        for rid in ids:
            allocator.free(rid)
        points.append({"prompts": prompts, "decodes": len(contexts), "context": sum(contexts),
                       "features": [len(contexts), sum(prompts), sum(p * p for p in prompts),
                                    sum(contexts)], "seconds": seconds,
                       "other_cpu": monitor.cores()})
    costs = fit(np.array([p["features"] for p in points], dtype=np.float64),
                np.array([p["seconds"] for p in points]))
    for p in points:
        p["fitted"] = costs.iteration(*p["features"])
    return costs, points


# ----------------------------------------------------------------------------- simulation

def simulate_orca(arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
                  costs: Costs, max_batch: int) -> list[float]:
    """Finish time of each request (arrivals sorted) under iteration-level scheduling."""
    a, b_decode, b_prefill, q, c = dataclasses.astuple(costs)
    n, finish = len(arrivals), [0.0] * len(arrivals)
    t, it, nxt, context = 0.0, 0, 0, 0  # it: index of the next iteration
    running: list[tuple[int, int]] = []  # heap of (index of its last iteration, request)
    while nxt < n or running:
        if not running and arrivals[nxt] > t:
            t = arrivals[nxt]
        decode, new = len(running), []
        while nxt < n and decode + len(new) < max_batch and arrivals[nxt] <= t:
            new.append(nxt)
            nxt += 1
        if new:  # the running decodes plus the new prompts, whole
            t += (a + b_decode * decode + c * context
                  + sum(b_prefill * prompts[i] + q * prompts[i] ** 2 for i in new))
            context += decode
            for i in new:
                heapq.heappush(running, (it + outputs[i] - 1, i))
                context += prompts[i]
            it += 1
        else:  # decodes only, until the first finish or until a waiting request can join
            arrival = arrivals[nxt] if nxt < n and decode < max_batch else math.inf
            for _ in range(running[0][0] - it + 1):
                t += a + b_decode * decode + c * context
                context += decode
                it += 1
                if t >= arrival:
                    break
        while running and running[0][0] < it:
            _, i = heapq.heappop(running)
            finish[i] = t
            context -= prompts[i] + outputs[i] - 1
    return finish


def simulate_request(arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
                     costs: Costs, max_batch: int) -> list[float]:
    """Finish time of each request (arrivals sorted) under request-level batching."""
    n, finish = len(arrivals), [0.0] * len(arrivals)
    t, nxt = 0.0, 0
    while nxt < n:
        t = max(t, arrivals[nxt])
        batch = [nxt]
        nxt += 1
        while nxt < n and len(batch) < max_batch and arrivals[nxt] <= t:
            batch.append(nxt)
            nxt += 1
        size, pad = len(batch), max(prompts[i] for i in batch)
        steps = max(outputs[i] for i in batch) - 1  # decode iterations after the prefill
        # A row's k-th decode runs at context prompt + min(k, output) - 1 (a finished row
        # recomputes its last token in place).
        context = 0
        for i in batch:
            m = min(steps, outputs[i])
            context += steps * (prompts[i] - 1) + m * (m + 1) // 2 + (steps - m) * outputs[i]
        t += (costs.iteration(0, size * pad, size * pad * pad, 0)
              + steps * costs.iteration(size, 0, 0, 0) + costs.c * context)
        for i in batch:
            finish[i] = t
    return finish


SIMULATORS: dict[str, Callable[..., list[float]]] = {
    "orca": simulate_orca, "request": simulate_request}


def make_stream(args: argparse.Namespace, seed: int) -> tuple[np.ndarray, list[int], list[int]]:
    """Unit-rate Poisson arrivals (the first at 0) and Orca-workload lengths for ``seed``."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, args.num_requests)
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_requests)
    gaps = rng.exponential(1.0, args.num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps), prompts.tolist(), outputs.tolist()


def measure(policy: str, costs: Costs, rate: float, streams: Sequence[tuple],
            args: argparse.Namespace) -> dict[str, Any]:
    """One point (``serving_sweep``'s keys), throughput and percentiles averaged over streams."""
    throughputs, p50s, p90s = [], [], []
    for unit_arrivals, prompts, outputs in streams:
        arrivals = unit_arrivals / rate if math.isfinite(rate) else np.zeros(len(prompts))
        finish = np.array(SIMULATORS[policy](arrivals.tolist(), prompts, outputs, costs,
                                             args.max_batch_size))
        throughputs.append(len(finish) / (finish.max() - arrivals[0]))
        keep = slice(math.ceil(args.warmup_fraction * len(finish)), None)
        norm = (finish - arrivals)[keep] / np.array(outputs)[keep]
        p50s.append(np.percentile(norm, 50))
        p90s.append(np.percentile(norm, 90))
    return {"policy": policy, "rate": rate, "request_throughput": float(np.mean(throughputs)),
            "norm_latency": {"p50": float(np.mean(p50s)), "p90": float(np.mean(p90s))}}


def sweep(costs: Costs, streams: Sequence[tuple], args: argparse.Namespace
          ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Each policy's saturation throughput and its points at ``--load-fractions`` of it."""
    saturation, points = {}, []
    for policy in POLICIES:
        saturation[policy] = measure(policy, costs, math.inf, streams, args)["request_throughput"]
        points += [measure(policy, costs, f * saturation[policy], streams, args)
                   for f in args.load_fractions]
    return saturation, points


def ratios(points: Sequence[dict[str, Any]], saturation: dict[str, float],
           factors: Sequence[float], percentile: str = "p50") -> tuple[str, list[dict[str, Any]]]:
    """``serving_sweep.ratio_table`` over the points below each policy's saturation."""
    below = [p for p in points if p["rate"] < saturation[p["policy"]]]
    return serving_sweep.ratio_table(below, POLICIES, factors, percentile)


# ----------------------------------------------------------------------------- CLI

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a few seconds: {QUICK} unless given")
    parser.add_argument("--model", default="orca-tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--costs", help="A,BD,BP,Q,C in seconds: skip the calibration")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[64, 320])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128, 256, 512])
    parser.add_argument("--min-seconds", type=float, default=0.3,
                        help="timing per calibration iteration (at least 3 runs)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512],
                        metavar=("MIN", "MAX"), help="prompt ~ U[MIN, MAX]")
    parser.add_argument("--output-len", type=int, nargs=2, default=[1, 128],
                        metavar=("MIN", "MAX"), help="output ~ U[MIN, MAX]")
    parser.add_argument("--num-requests", type=int, default=2000, help="requests per stream")
    parser.add_argument("--seeds", type=int, default=3, help="streams averaged per point")
    parser.add_argument("--load-fractions", type=float, nargs="+",
                        default=[0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9,
                                 0.95, 1.05],
                        help="rates as fractions of each policy's saturation throughput")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="earliest arrivals left out of the latency statistics")
    parser.add_argument("--latency-factors", type=float, nargs="+", default=[1.5, 2, 3, 5],
                        help="limits on normalized latency, times its lowest value")
    parser.add_argument("--cost-scales", type=float, nargs="+", default=[1, 0.5, 0.25, 0.1, 0.05],
                        help="sensitivity: factors on the per-token costs (a kept)")
    parser.add_argument("--json", default=str(RESULTS / "policy_model.json"))
    return serving.parse_with_quick(parser, argv, QUICK)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    record: dict[str, Any] = {"benchmark": "policy_model", "args": vars(args)}
    mean_prompt = sum(args.prompt_len) / 2
    if args.costs:
        costs = Costs(*map(float, args.costs.split(",")))
    else:
        costs, calibration = calibrate(args)
        record.update(environment=serving.environment(), calibration=calibration)
        print(f"calibration ({args.model}, {args.dtype}, {record['environment']['threads']} "
              f"threads; C = the decodes' cached tokens):")
        print(f"{'prompts':>20}{'decodes':>8}{'C':>7}{'ms':>9}{'fitted':>9}  others")
        for p in calibration:
            others = "-" if p["other_cpu"] is None else f"{p['other_cpu']:.2f}"
            print(f"{'+'.join(map(str, p['prompts'])) or '-':>20}{p['decodes']:>8}"
                  f"{p['context']:>7}{p['seconds'] * 1e3:>9.2f}{p['fitted'] * 1e3:>9.2f}"
                  f"{others:>8}")
        error = max(abs(p["fitted"] / p["seconds"] - 1) for p in calibration)
        print(f"max relative error of the fit: {error:.1%}")
        noisy = sum((p["other_cpu"] or 0) > 0.25 for p in calibration)
        if noisy:
            print(f"WARNING: other processes used > 0.25 cores during {noisy} of the "
                  f"{len(calibration)} timings: the costs are unreliable; run on a quiet machine")
    print(f"costs: {costs}")
    print(f"a {mean_prompt:g}-token prompt costs {costs.prefill_in_decode_steps(mean_prompt):.1f} "
          f"decode steps (batch 1)")
    streams = [make_stream(args, seed) for seed in range(args.seeds)]
    sensitivity = []
    for scale in args.cost_scales:
        scaled = costs.scaled(scale)
        saturation, points = sweep(scaled, streams, args)
        tables = {pct: ratios(points, saturation, args.latency_factors, pct)
                  for pct in ("p50", "p90")}
        sensitivity.append({"scale": scale, "costs": dataclasses.asdict(scaled),
                            "prefill_decode_steps": scaled.prefill_in_decode_steps(mean_prompt),
                            "saturation": saturation, "points": points,
                            "ratios": tables["p50"][1] + tables["p90"][1]})
        if scale != args.cost_scales[0]:
            continue
        print(f"\nsaturation (all {args.num_requests} requests at once, max batch "
              f"{args.max_batch_size}): " + ", ".join(f"{p} {v:.2f} req/s"
                                                      for p, v in saturation.items()))
        print(f"{'load':>6}" + "".join(f"{p + ' req/s':>15}{'p50 ms/tok':>11}{'p90':>8}"
                                       for p in POLICIES))
        for i, fraction in enumerate(args.load_fractions):
            cells = [points[j * len(args.load_fractions) + i] for j in range(len(POLICIES))]
            print(f"{fraction:>6.2f}" + "".join(
                f"{p['request_throughput']:>15.2f}{p['norm_latency']['p50'] * 1e3:>11.1f}"
                f"{p['norm_latency']['p90'] * 1e3:>8.1f}" for p in cells))
        for pct, (table, _) in tables.items():
            name = "median" if pct == "p50" else pct
            print(f"\nThroughput sustained under a limit on {name} normalized latency "
                  f"(costs x {scale:g}):\n{table}")
    print("\nSensitivity: per-token costs x scale (a kept); orca/request under limits on the "
          "median")
    print(f"{'scale':>6}{'prefill/decode':>15}{'orca sat':>10}{'request sat':>12}"
          + "".join(f"{f'{f:g}x':>9}" for f in args.latency_factors))
    for s in sensitivity:
        cells = []
        for row in s["ratios"][:len(args.latency_factors)]:
            value = row["ratio"]["orca"]
            bounded = any(v["lower_bound"] for v in row["throughput"].values())
            cells.append("-" if value is None else f"{value:.2f}{'*' if bounded else ''}")
        print(f"{s['scale']:>6g}{s['prefill_decode_steps']:>15.1f}"
              f"{s['saturation']['orca']:>10.2f}{s['saturation']['request']:>12.2f}"
              + "".join(f"{c:>9}" for c in cells))
    elapsed = time.perf_counter() - started
    print(f"done in {elapsed:.1f} s")
    serving.write_json(args.json, {**record, "costs": dataclasses.asdict(costs),
                                   "sensitivity": sensitivity, "elapsed": elapsed})


if __name__ == "__main__":
    sys.exit(main())
