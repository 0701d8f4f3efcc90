"""Prefix caching benchmark: the same request streams with ``enable_prefix_caching`` off and on.

    python bench/prefix.py [--policy orca paged] [--quick] [--json FILE] [--plot PNG ...]

Two workloads, each run in-process (``AsyncEngine``) on one loaded model (default the real one,
``smollm2-135m-instruct``), a fresh engine (an empty cache) per run:
- ``system_prompt``: ``--num-requests`` requests share one ``--system-len``-token system prompt,
  each followed by its own question of ``--question-len`` U[MIN, MAX] tokens, and generate
  ``--output-len`` tokens; Poisson arrivals at each ``--rate`` requests/s (open loop; default
  4/s, and ``inf``: all at once, so the throughput is each setting's capacity rather than
  the offered load).
- ``multi_turn``: ``--conversations`` conversations of ``--turns`` turns, starting as a Poisson
  process at ``--conversation-rate``; each turn sends the conversation so far (every earlier
  message and answer) plus a new message of ``--message-len`` U[MIN, MAX] tokens, as soon as the
  previous answer (``--answer-len`` tokens) is back.
Prompts are random token ids (no special tokens), every request greedy with ``ignore_eos``, and
the streams are a function of the arguments and ``--seed`` only, so both settings see the same
requests. Both settings get the same KV pool: ``--kv-cache-tokens``, else ``KV_CACHE_TOKENS``.
Reported per run: TTFT p50 / p90 (from a request's scheduled arrival, or a turn's send), output
tokens/s and requests/s (first arrival to last finish), the prefix cache's hit rate; then each
workload's TTFT p50 (off / on) and throughput (on / off) ratios. ``--plot`` draws both settings'
TTFT (p50 bars, p90 marks) and output tokens/s per workload into PNG files (matplotlib).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import serving  # noqa: E402

QUICK = dict(num_requests=16, system_len=512, conversations=6, turns=4)
# Each workload's KV pool unless --kv-cache-tokens is given: system_prompt's holds about 24
# uncached Orca reservations (prompt + max_tokens each); multi_turn's holds every conversation's
# whole history, so nothing cached is evicted before its next turn.
KV_CACHE_TOKENS = {"system_prompt": 16384, "multi_turn": 32768}


@dataclass
class Record:
    """One request as the client saw it; times in seconds after the run's start."""

    arrival: float
    first_token: float | None = None
    finish: float | None = None
    prompt_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0


def _tokens(rng: random.Random, n: int, vocab: list[int]) -> list[int]:
    return [rng.choice(vocab) for _ in range(n)]


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    clock, times = 0.0, []
    for _ in range(n):
        times.append(clock)
        clock += rng.expovariate(rate)
    return times


def system_prompt_stream(args: argparse.Namespace, vocab: list[int], rate: float
                         ) -> list[tuple[float, list[int]]]:
    """(arrival, prompt) per request: one shared system prompt, then an own question."""
    rng = random.Random(f"{args.seed}:system")
    system = _tokens(rng, args.system_len, vocab)
    arrivals = _arrivals(rng, args.num_requests, rate)
    return [(at, system + _tokens(rng, rng.randint(*args.question_len), vocab))
            for at in arrivals]


def conversation_stream(args: argparse.Namespace, vocab: list[int]
                        ) -> list[tuple[float, list[list[int]]]]:
    """(start, each turn's new message) per conversation."""
    rng = random.Random(f"{args.seed}:conversations")
    starts = _arrivals(rng, args.conversations, args.conversation_rate)
    return [(at, [_tokens(rng, rng.randint(*args.message_len), vocab)
                  for _ in range(args.turns)]) for at in starts]


async def _send(engine: Any, prompt: list[int], max_tokens: int, record: Record,
                start: float) -> None:
    from orca_ext.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    record.prompt_len = len(prompt)
    async for output in engine.generate(prompt, params):
        if output.outputs[0].token_ids and record.first_token is None:
            record.first_token = time.perf_counter() - start
        record.output_ids = list(output.outputs[0].token_ids)
        record.cached_tokens = output.num_cached_tokens
    record.finish = time.perf_counter() - start


async def run_system_prompt(engine: Any, stream: list[tuple[float, list[int]]],
                            output_len: int) -> tuple[list[Record], float]:
    start = time.perf_counter()
    records = [Record(at) for at, _ in stream]

    async def one(prompt: list[int], record: Record) -> None:
        await asyncio.sleep(max(0.0, start + record.arrival - time.perf_counter()))
        await _send(engine, prompt, output_len, record, start)

    await asyncio.gather(*(one(p, r) for (_, p), r in zip(stream, records)))
    return records, time.perf_counter() - start


async def run_multi_turn(engine: Any, stream: list[tuple[float, list[list[int]]]],
                         answer_len: int) -> tuple[list[Record], float]:
    start = time.perf_counter()
    records: list[Record] = []

    async def conversation(at: float, messages: list[list[int]]) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        history: list[int] = []
        for message in messages:
            history = history + message
            record = Record(time.perf_counter() - start)
            records.append(record)
            await _send(engine, history, answer_len, record, start)
            history = history + record.output_ids

    await asyncio.gather(*(conversation(at, m) for at, m in stream))
    return records, time.perf_counter() - start


def summarize(records: Sequence[Record], duration: float, before: Any,
              after: Any) -> dict[str, Any]:
    """TTFT percentiles (seconds), throughputs, and the cache's counts between two stats."""
    done = [r for r in records if r.finish is not None and r.first_token is not None]
    ttft = serving.percentiles([r.first_token - r.arrival for r in done])
    outputs = sum(len(r.output_ids) for r in done)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"num_requests": len(records), "completed": len(done), "duration": duration,
            "ttft": ttft, "output_throughput": outputs / duration,
            "request_throughput": len(done) / duration, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "hit_rate": hits / max(1, queries),
            "num_prompt_tokens": sum(r.prompt_len for r in done),
            "cached_prompt_tokens": sum(r.cached_tokens for r in done)}


def _line(workload: str, rate: float | None, policy: str, caching: bool,
          point: dict[str, Any]) -> str:
    ttft = point["ttft"]
    return (f"{workload:<14}{'-' if rate is None else f'{rate:g}':>5} {policy:<7}"
            f"{'on' if caching else 'off':<5}"
            f"{point['completed']:>4}/{point['num_requests']:<4}"
            f"{ttft['p50'] * 1e3:>10.0f}{ttft['p90'] * 1e3:>10.0f}"
            f"{point['output_throughput']:>11.1f}{point['request_throughput']:>8.2f}"
            f"{point['hit_rate']:>8.0%}")


def scenario(point: dict[str, Any], policies: int) -> str:
    """A plot label for a point's workload (and rate, and policy when several ran)."""
    if point["workload"] == "multi_turn":
        name = "multi-turn"
    else:
        rate = point["rate"]
        name = "system prompt,\n" + ("all at once" if rate == math.inf else f"Poisson {rate:g}/s")
    return f"{name}\n({point['policy']})" if policies > 1 else name


def plot(points: Sequence[dict[str, Any]], title: str, paths: Sequence[Path]) -> None:
    """TTFT and output tokens/s with the cache off and on, one group of bars per workload."""
    plt = common.pyplot(paths)
    if plt is None:
        return
    policies = len({p["policy"] for p in points})
    names = list(dict.fromkeys(scenario(p, policies) for p in points))
    fig, (ttft, throughput) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for offset, caching, color in ((-width / 2, False, "tab:gray"), (width / 2, True, "tab:blue")):
        mine = {scenario(p, policies): p for p in points if p["caching"] == caching}
        xs = [i + offset for i in range(len(names))]
        label = f"prefix cache {'on' if caching else 'off'}"
        ttft.bar(xs, [1e3 * mine[n]["ttft"]["p50"] for n in names], width, color=color,
                 label=label)
        ttft.plot(xs, [1e3 * mine[n]["ttft"]["p90"] for n in names], "_", color="black",
                  markersize=14, label="p90" if caching else None)
        throughput.bar(xs, [mine[n]["output_throughput"] for n in names], width, color=color,
                       label=label)
    for ax, ylabel in ((ttft, "TTFT (ms, log scale): p50 bar, p90 mark"),
                       (throughput, "Output tokens/s")):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ttft.set_yscale("log")
    ttft.yaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:g}"))
    ttft.yaxis.set_minor_formatter(plt.NullFormatter())
    fig.suptitle(title, fontsize=9)
    common.save_figure(fig, paths)


HEADER = (f"{'workload':<14}{'rate':>5} {'policy':<7}{'cache':<5}{'done':>9}{'TTFT p50':>10}"
          f"{'p90 ms':>10}{'out tok/s':>11}{'req/s':>8}{'hits':>8}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", nargs="+", choices=("orca", "paged"), default=["orca"])
    parser.add_argument("--workloads", nargs="+", choices=("system_prompt", "multi_turn"),
                        default=["system_prompt", "multi_turn"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, nargs=2, default=[32, 128],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, nargs="+", default=[4.0, math.inf],
                        help="system_prompt: requests/s, one pair of runs each (inf: at once)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-len", type=int, nargs=2, default=[256, 512],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--answer-len", type=int, default=64)
    parser.add_argument("--conversation-rate", type=float, default=2.0,
                        help="multi_turn: conversations started per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help=f"a small run on a busy machine: {QUICK}")
    serving.add_engine_args(parser)
    parser.set_defaults(max_batch_size=64)
    parser.add_argument("--json", default=None, help="write the JSON record here")
    parser.add_argument("--plot", nargs="+", default=[], metavar="PNG",
                        help="draw TTFT and throughput, off and on, into these files")
    args = serving.parse_with_quick(parser, argv, QUICK)

    from orca_ext.async_engine import AsyncEngine
    from orca_ext.build import build_engine
    from orca_ext.config import EngineConfig

    loaded = serving.load(args)
    special = set(loaded.info.eos_token_ids) | {loaded.config.bos_token_id}
    vocab = [t for t in range(loaded.config.vocab_size) if t not in special]
    streams = {("system_prompt", rate): system_prompt_stream(args, vocab, rate)
               for rate in args.rate}
    streams["multi_turn", None] = conversation_stream(args, vocab)
    runners = {"system_prompt": (run_system_prompt, args.output_len),
               "multi_turn": (run_multi_turn, args.answer_len)}
    print(HEADER, flush=True)
    points = []
    for (workload, rate), stream in streams.items():
        if workload not in args.workloads:
            continue
        for policy in args.policy:
            by_setting = {}
            for caching in (False, True):
                config = EngineConfig(loaded, policy=policy, max_batch_size=args.max_batch_size,
                                      block_size=args.block_size,
                                      kv_cache_tokens=(args.kv_cache_tokens
                                                       or KV_CACHE_TOKENS[workload]),
                                      enable_prefix_caching=caching)
                engine = AsyncEngine(build_engine(config))
                try:  # one-time costs first, on prompts the streams never send
                    warm = [[vocab[-1]] * 16, [vocab[-2]] * 40]
                    asyncio.run(run_system_prompt(engine, [(0.0, p) for p in warm], 4))
                    run, max_tokens = runners[workload]
                    monitor, before = serving.OtherCpu(), engine.stats()
                    records, duration = asyncio.run(run(engine, stream, max_tokens))
                    point = summarize(records, duration, before, engine.stats())
                finally:
                    engine.shutdown()
                point.update(workload=workload, rate=rate, policy=policy, caching=caching,
                             other_cpu=monitor.cores())
                by_setting[caching] = point
                points.append(point)
                print(_line(workload, rate, policy, caching, point), flush=True)
            off, on = by_setting[False], by_setting[True]
            ratios = {q: off["ttft"][q] / on["ttft"][q] for q in ("p50", "p90")}
            print(f"{'':<20}{policy:<7}TTFT p50 off/on {ratios['p50']:.1f}x, p90 "
                  f"{ratios['p90']:.1f}x; throughput on/off "
                  f"{on['output_throughput'] / off['output_throughput']:.2f}x", flush=True)
    if args.json:
        serving.write_json(args.json, {"benchmark": "prefix", "args": vars(args),
                                       "environment": serving.environment(), "points": points})
    if args.plot:
        env = serving.environment()
        plot(points, f"Prefix caching: {args.model}, policy {'/'.join(args.policy)}, "
             f"{env['threads']} threads, {env['time'][:10]}", [Path(p) for p in args.plot])


if __name__ == "__main__":
    sys.exit(main())
