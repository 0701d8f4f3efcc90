"""Orca's experiment: median normalized latency against throughput under Poisson load, for the
``orca``, ``request`` and ``paged`` policies on the same model and the same request streams.

    python bench/serving_sweep.py [--quick] [--policies orca request paged]
        [--num-requests 64] [--min-requests 16] [--point-seconds 20]
        [--load-fractions 0.1 0.2 ...] | [--rates 0.2 0.5 ...] [--stop-factor 6]
        [--latency-factors 1.5 2 3 5] [--headline-factor 2] [--plot bench/orca_sweep.png]

How it runs (in-process: one loaded model, an AsyncEngine per policy):
1. Capacity: the ``orca`` engine runs ``--capacity-requests`` requests arriving all at once;
   its request throughput ``C`` sets the rate grid ``C * --load-fractions`` (or ``--rates``).
2. Rates go low to high; at each rate every policy runs in turn (interleaved, so noise from
   other processes on a shared machine hits all policies alike; the ``others`` column says how
   many cores other processes used during the point). A point at rate ``r`` sends the first
   ``clamp(r * point_seconds, min_requests, num_requests)`` requests of the stream for
   ``(workload, rate, seed)``: the same requests for every policy (see bench/serving.py). A
   policy stops once its median normalized latency exceeds ``--stop-factor`` times its value
   at the lowest rate: past saturation more points only add queueing. A point during which
   other processes used more than ``--noisy-cores`` of CPU is measured again (``--retries``).
3. Throughput at equal latency: for a limit ``L`` on median normalized latency, the throughput
   a policy sustains is the highest measured throughput before the first rate whose latency
   exceeds L, linearly interpolated up to that crossing. Limits are ``--latency-factors`` times the
   lowest median normalized latency measured (the unloaded engine); the table gives each
   policy's sustained throughput and its ratio to ``request``. A second table does the same
   on the p90 (``--ratio-percentiles``), where request-level batching hurts most.
Writes bench/results/serving_sweep.{json,png} (git-ignored) and ``--plot`` if given.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import serving  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STYLE = {"orca": ("tab:blue", "o", "-"), "paged": ("tab:green", "s", "--"),
         "request": ("tab:red", "^", ":")}
QUICK = {"num_requests": 12, "min_requests": 6, "point_seconds": 6.0,
         "capacity_requests": 12, "load_fractions": [0.15, 0.5, 0.9],
         "prompt_len": [32, 256], "output_len": [1, 64]}


def requests_at(rate: float, args: argparse.Namespace) -> int:
    return min(args.num_requests, max(args.min_requests, math.ceil(rate * args.point_seconds)))


def norm_p50(point: dict[str, Any], percentile: str = "p50") -> float:
    """The point's normalized latency at ``percentile`` (median by default, as in Orca)."""
    return point["norm_latency"][percentile]


def measure_quietly(backend: serving.InProcessBackend, spec: serving.WorkloadSpec,
                    num_requests: int, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """``serving.measure``, run again (up to ``--retries`` times) while other processes used
    more than ``--noisy-cores`` of CPU during it; the quietest attempt counts."""
    attempts = []
    for attempt in range(args.retries + 1):
        point, _ = serving.measure(backend, spec, num_requests, rate, args.seed)
        attempts.append(point)
        others = point["other_cpu"]
        if others is None or others <= args.noisy_cores:
            break
        if attempt < args.retries:
            print(f"  (rate {rate:.2f}: other processes used {others:.2f} cores; measuring "
                  "again)", flush=True)
    best = min(attempts, key=lambda p: p["other_cpu"] or 0.0)
    best["attempts"] = len(attempts)
    return best


def run_sweep(loaded: Any, policies: Sequence[str], spec: serving.WorkloadSpec,
              args: argparse.Namespace) -> tuple[list[dict[str, Any]], float | None,
                                                 list[float]]:
    """Every policy over the rate grid, interleaved: at each rate the policies run one after
    another, so a burst of load from elsewhere on a shared machine hits them alike. Returns the
    points, orca's capacity (req/s; None with ``--rates``) and the rates."""
    from orca_ext.async_engine import AsyncEngine
    from orca_ext import EngineConfig, build_engine

    backends: dict[str, serving.InProcessBackend] = {}
    try:
        for policy in policies:  # one engine each, alive together (KV caches are small here)
            kwargs = serving.engine_kwargs(args, spec)
            if policy == "paged":
                kwargs["max_num_batched_tokens"] = args.paged_max_num_batched_tokens
            backends[policy] = serving.InProcessBackend(
                AsyncEngine(build_engine(EngineConfig(loaded, policy=policy, **kwargs))))
            serving.warmup(backends[policy], spec)
        capacity, rates = None, args.rates
        if rates is None:
            point = measure_quietly(backends["orca"], spec, args.capacity_requests, math.inf,
                                    args)
            capacity = point["request_throughput"]
            rates = [capacity * f for f in args.load_fractions]
            print(f"orca capacity: {capacity:.2f} req/s, {point['output_throughput']:.0f} "
                  f"output tok/s ({args.capacity_requests} requests at once); rates "
                  f"{', '.join(f'{r:.2f}' for r in rates)}", flush=True)
        points: list[dict[str, Any]] = []
        first: dict[str, dict[str, Any]] = {}
        active = list(policies)
        print(serving.format_table([]), flush=True)
        for rate in rates:
            for policy in list(active):
                point = measure_quietly(backends[policy], spec, requests_at(rate, args), rate,
                                        args)
                point["policy"] = policy
                points.append(point)
                print(serving.format_table([point]).splitlines()[-1], flush=True)
                first.setdefault(policy, point)
                if norm_p50(point) > args.stop_factor * norm_p50(first[policy]):
                    print(f"{policy}: saturated (median normalized latency > "
                          f"{args.stop_factor:g}x its lowest-rate value); no higher rates",
                          flush=True)
                    active.remove(policy)
        return points, capacity, list(rates)
    finally:
        for backend in backends.values():
            backend.engine.shutdown()


def sustained(points: Sequence[dict[str, Any]], limit: float,
              percentile: str = "p50") -> tuple[float | None, bool]:
    """Throughput a policy sustains with normalized latency (at ``percentile``) <= ``limit``, up
    to the first rate that breaks it (interpolated linearly to the crossing; a noisy dip at a
    higher rate does not count): (req/s, or None if even the lowest rate breaks it; True if no
    rate broke it, so the value is a lower bound)."""
    ordered = sorted(points, key=lambda p: p["rate"])
    best: float | None = None
    for i, p in enumerate(ordered):
        y = norm_p50(p, percentile)
        if y > limit:
            if i == 0:
                return None, False
            prev = ordered[i - 1]
            y0, x0 = norm_p50(prev, percentile), prev["request_throughput"]
            x = x0 + (limit - y0) / (y - y0) * (p["request_throughput"] - x0)
            return max(best or 0.0, x), False
        best = max(best or 0.0, p["request_throughput"])
    return best, best is not None


def ratio_table(points: Sequence[dict[str, Any]], policies: Sequence[str],
                factors: Sequence[float], percentile: str = "p50"
                ) -> tuple[str, list[dict[str, Any]]]:
    """Each policy's sustained throughput under limits ``factors`` x the lowest normalized
    latency (at ``percentile``) measured, and its ratio to ``request``."""
    base = min(norm_p50(p, percentile) for p in points)
    rows, lines = [], []
    others = [p for p in policies if p != "request"]
    header = (f"{'limit (ms/token)':>18}"
              + "".join(f"{p + ' req/s':>15}" for p in policies)
              + "".join(f"{p + '/request':>16}" for p in others if "request" in policies))
    lines.append(header)
    for factor in factors:
        limit = factor * base
        row: dict[str, Any] = {"percentile": percentile, "factor": factor, "limit": limit,
                               "throughput": {}, "ratio": {}}
        cells = []
        for policy in policies:
            value, lower = sustained([p for p in points if p["policy"] == policy], limit,
                                     percentile)
            row["throughput"][policy] = {"value": value, "lower_bound": lower}
            text = "-" if value is None else f"{'>=' if lower else ''}{value:.2f}"
            cells.append(f"{text:>15}")
        if "request" in policies:
            ref = row["throughput"]["request"]
            for policy in others:
                mine = row["throughput"][policy]
                ratio = None if not ref["value"] or mine["value"] is None else (
                    mine["value"] / ref["value"])
                row["ratio"][policy] = ratio
                bounded = mine["lower_bound"] or ref["lower_bound"]
                text = "-" if ratio is None else f"{ratio:.2f}x{'*' if bounded else ''}"
                cells.append(f"{text:>16}")
        lines.append(f"{f'{factor:g}x = {limit * 1e3:.1f}':>18}" + "".join(cells))
        rows.append(row)
    lines.append(">=: the policy stayed under the limit at every rate measured (a lower bound); "
                 "*: a ratio involving one; -: no rate met the limit")
    return "\n".join(lines), rows


def plot(points: Sequence[dict[str, Any]], policies: Sequence[str], limit: float, title: str,
         paths: Sequence[Path]) -> None:
    plt = common.pyplot(paths)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    top = 0.0
    for policy in policies:
        mine = sorted((p for p in points if p["policy"] == policy), key=lambda p: p["rate"])
        color, marker, line = STYLE.get(policy, ("black", "x", "-"))
        xs = [p["request_throughput"] for p in mine]
        ys = [norm_p50(p) * 1e3 for p in mine]
        ax.plot(xs, ys, color=color, marker=marker, linestyle=line, label=policy)
        top = max(top, *ys)
    base = min(norm_p50(p) for p in points) * 1e3
    ax.axhline(limit * 1e3, color="gray", linestyle="--", linewidth=0.8)
    ax.text(ax.get_xlim()[0], limit * 1e3, " latency limit", color="gray", va="bottom",
            fontsize=8)
    ax.set_ylim(0, min(top * 1.05, base * 8))  # like Orca's figures: the knee, not the blow-up
    ax.set_xlim(left=0)
    ax.set_xlabel("Throughput (req/s)")
    ax.set_ylabel("Median normalized latency (ms/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    common.save_figure(fig, paths)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test in a minute or two: {QUICK} unless given")
    parser.add_argument("--policies", nargs="+", default=["orca", "request", "paged"],
                        choices=["orca", "request", "paged"])
    parser.add_argument("--num-requests", type=int, default=64, help="most requests per point")
    parser.add_argument("--min-requests", type=int, default=16, help="fewest requests per point")
    parser.add_argument("--point-seconds", type=float, default=20.0,
                        help="a point sends rate * this many requests (within the bounds)")
    parser.add_argument("--capacity-requests", type=int, default=32)
    parser.add_argument("--load-fractions", type=float, nargs="+",
                        default=[0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.25, 1.5],
                        help="rates as fractions of orca's measured capacity")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="explicit rates (req/s) instead of capacity fractions")
    parser.add_argument("--stop-factor", type=float, default=6.0,
                        help="stop a policy once its median normalized latency exceeds this "
                        "times its value at the lowest rate")
    parser.add_argument("--noisy-cores", type=float, default=0.25,
                        help="re-measure a point while other processes used more CPU than this")
    parser.add_argument("--retries", type=int, default=2, help="re-measurements of a noisy point")
    parser.add_argument("--paged-max-num-batched-tokens", type=int, default=None,
                        help="paged only: per-iteration token budget (chunked prefill)")
    parser.add_argument("--latency-factors", type=float, nargs="+", default=[1.5, 2, 3, 5],
                        help="limits on median normalized latency, times its lowest value")
    parser.add_argument("--ratio-percentiles", nargs="+", default=["p50", "p90"],
                        choices=[f"p{q}" for q in serving.PERCENTILES],
                        help="a ratio table for each (Orca's figures use the median)")
    parser.add_argument("--headline-factor", type=float, default=2.0,
                        help="the limit drawn on the plot")
    parser.add_argument("--json", default=str(RESULTS / "serving_sweep.json"))
    parser.add_argument("--plot", nargs="*", default=[],
                        help="more places for the PNG (bench/results/serving_sweep.png always)")
    serving.add_workload_args(parser)
    serving.add_engine_args(parser)
    return serving.parse_with_quick(parser, argv, QUICK)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    loaded = serving.load(args)
    spec = serving.spec_for_model(args, loaded)
    print(f"model {args.model}: {loaded.config.num_layers} layers, hidden "
          f"{loaded.config.hidden_size}; workload {args.workload} {spec}; max batch size "
          f"{args.max_batch_size}; {serving.environment()}", flush=True)
    policies = list(dict.fromkeys(args.policies))
    if args.rates is None and "orca" not in policies:
        raise SystemExit("capacity fractions need the orca policy; pass --rates instead")
    points, capacity, rates = run_sweep(loaded, policies, spec, args)
    print()
    print(serving.format_table(points))
    rows = []
    for percentile in args.ratio_percentiles:
        table, mine = ratio_table(points, policies, args.latency_factors, percentile)
        rows += mine
        name = "median" if percentile == "p50" else percentile
        print(f"\nThroughput sustained under a limit on {name} normalized latency:")
        print(table)
    base = min(norm_p50(p) for p in points)
    workload = (f"prompt U[{spec.prompt_len[0]},{spec.prompt_len[1]}], output "
                f"U[{spec.output_len[0]},{spec.output_len[1]}]" if spec.kind == "orca"
                else "ShareGPT-like lognormal lengths")
    title = (f"{args.model}, {workload}, max batch {args.max_batch_size}, "
             f"{serving.environment()['threads']} threads")
    plot(points, policies, args.headline_factor * base, title,
         [RESULTS / "serving_sweep.png", *map(Path, args.plot)])
    elapsed = time.perf_counter() - started
    print(f"done in {elapsed:.0f} s")
    serving.write_json(args.json, {
        "benchmark": "serving_sweep", "args": vars(args), "workload": dataclasses.asdict(spec),
        "environment": serving.environment(),
        "capacity": capacity, "rates": rates, "points": points, "ratios": rows,
        "elapsed": elapsed})


if __name__ == "__main__":
    sys.exit(main())
