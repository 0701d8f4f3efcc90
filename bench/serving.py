"""Open-loop serving benchmark: Poisson arrivals against the engine in-process or a server.

    python bench/serving.py [--backend inproc|http] [--rate 1 2 inf] [--num-requests 64]
        [--workload orca|sharegpt] [--seed 0] [--policy orca] [--max-batch-size 16]
        [--url http://127.0.0.1:8000] [--prompt-kind ids|text] [--json FILE]

Requests arrive as a Poisson process at ``--rate`` requests/s (``inf``: all at once) and are
never held back by earlier ones (open loop). A request stream is a function of
``(workload, num_requests, rate, seed)`` only: lengths and prompts are drawn per request in
order, and inter-arrival gaps are unit-mean exponentials scaled by ``1/rate``, so every policy
(and every rate) sees the same requests, and the first ``n`` requests of a stream are the stream
of ``n``. Every request is greedy with ``ignore_eos``, so it produces exactly its output length.

Workloads (``--workload``):
- ``orca``: Orca's synthetic workload (OSDI'22, sec. 6): prompt length ~ U[32, 512], output
  length ~ U[1, 128] (``--prompt-len``/``--output-len`` change the bounds).
- ``sharegpt``: a parametric stand-in for ShareGPT (no download possible): lognormal prompt and
  output lengths whose means match the ShareGPT means reported in the vLLM paper (SOSP'23,
  fig. 11: 161 prompt / 338 output tokens), with assumed log-std 1.0 (prompt) and 0.9 (output),
  i.e. medians of about 98 and 225 tokens and long tails. Lengths are clipped to [4, 1024] and
  then so that prompt + output fits the model's context (which lowers the means a little).

Per rate it reports request throughput, output tokens/s, and p50/p90/p99 of TTFT, TPOT (per
request: (latency - TTFT) / (outputs - 1)), ITL (every gap between two tokens), end-to-end
latency and normalized latency (latency / output tokens, Orca's metric). Latencies count from
the request's scheduled arrival, as seen by the client. Results print as a table and go to
``--json``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# ShareGPT stand-in: (mean tokens, log-std) of the lognormal prompt and output lengths.
SHAREGPT_PROMPT = (161.0, 1.0)
SHAREGPT_OUTPUT = (338.0, 0.9)
SHAREGPT_CLIP = (4, 1024)
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "latency", "norm_latency")


# ----------------------------------------------------------------------------- workload

@dataclass(frozen=True)
class WorkloadSpec:
    """What a request stream is drawn from."""

    kind: str = "orca"  # "orca" or "sharegpt"
    prompt_len: tuple[int, int] = (32, 512)  # orca only: U[min, max]
    output_len: tuple[int, int] = (1, 128)  # orca only: U[min, max]
    max_model_len: int = 1024  # prompt + output never exceed it
    vocab_size: int = 256  # prompt token ids are drawn from [0, vocab_size) minus special_ids
    special_ids: tuple[int, ...] = ()
    prompt_kind: str = "ids"  # "ids" (token ids) or "text" (random lowercase words)

    def __post_init__(self) -> None:
        if self.kind not in ("orca", "sharegpt"):
            raise ValueError(f"workload must be 'orca' or 'sharegpt', got {self.kind!r}")
        if self.prompt_kind not in ("ids", "text"):
            raise ValueError(f"prompt_kind must be 'ids' or 'text', got {self.prompt_kind!r}")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= min <= max, got {(low, high)}")


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt: list[int] | str
    prompt_len: int  # tokens (for text prompts: characters, one token each with a byte tokenizer)
    output_len: int
    arrival: float  # seconds after the start of the run


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def sample_lengths(spec: WorkloadSpec, rng: random.Random) -> tuple[int, int]:
    """One request's (prompt tokens, output tokens)."""
    if spec.kind == "orca":
        prompt, output = rng.randint(*spec.prompt_len), rng.randint(*spec.output_len)
    else:
        low, high = SHAREGPT_CLIP
        prompt = min(max(round(_lognormal(rng, *SHAREGPT_PROMPT)), low), high)
        output = min(max(round(_lognormal(rng, *SHAREGPT_OUTPUT)), low), high)
    output = min(output, spec.max_model_len - 1)
    return min(prompt, spec.max_model_len - output), output


def make_requests(spec: WorkloadSpec, num_requests: int, rate: float,
                  seed: int = 0) -> list[WorkloadRequest]:
    """The request stream for ``(spec, num_requests, rate, seed)``; the first arrives at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 (inf: all at once), got {rate}")
    lengths_rng, gaps_rng, tokens_rng = (random.Random(f"{seed}:{part}")
                                         for part in ("lengths", "gaps", "tokens"))
    special = set(spec.special_ids)
    pool = [t for t in range(spec.vocab_size) if t not in special]
    letters = "abcdefghijklmnopqrstuvwxyz"
    requests, clock = [], 0.0
    for index in range(num_requests):
        prompt_len, output_len = sample_lengths(spec, lengths_rng)
        if spec.prompt_kind == "ids":
            prompt: list[int] | str = [tokens_rng.choice(pool) for _ in range(prompt_len)]
        else:  # words of 1-8 letters separated by spaces, exactly prompt_len characters
            words = []
            while sum(map(len, words)) + len(words) < prompt_len + 1:
                words.append("".join(tokens_rng.choice(letters)
                                     for _ in range(tokens_rng.randint(1, 8))))
            prompt = " ".join(words)[:prompt_len]
        if index > 0 and math.isfinite(rate):
            clock += gaps_rng.expovariate(1.0) / rate
        requests.append(WorkloadRequest(index, prompt, prompt_len, output_len, clock))
    return requests


# ----------------------------------------------------------------------------- backends

OnTokens = Callable[[int], None]  # called with how many new tokens just arrived


class Backend(Protocol):
    """Sends one request and reports its tokens as they stream back. ``open``/``close`` bracket
    each run (each runs in its own event loop)."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def send(self, request: WorkloadRequest, on_tokens: OnTokens) -> tuple[int, str]:
        """Run ``request`` to the end; return (output tokens, finish reason)."""
        ...


class InProcessBackend:
    """Drives an ``AsyncEngine`` in this process (its loop thread runs the model)."""

    def __init__(self, engine: Any) -> None:  # orca_ext.async_engine.AsyncEngine
        self.engine = engine

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def send(self, request: WorkloadRequest, on_tokens: OnTokens) -> tuple[int, str]:
        from orca_ext.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        seen, reason = 0, "none"
        async for output in self.engine.generate(request.prompt, params):
            completion = output.outputs[0]
            if len(completion.token_ids) > seen:
                on_tokens(len(completion.token_ids) - seen)
                seen = len(completion.token_ids)
            reason = completion.finish_reason or reason
        return seen, reason


class HTTPBackend:
    """POSTs streaming ``/v1/completions`` to an OpenAI-compatible server. ``logprobs=0`` makes
    the server send a chunk per token (a byte tokenizer's partial characters add no text), and
    each chunk's ``logprobs.tokens`` says how many tokens it carries."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 3600.0,
                 logprobs: bool = True, transport: Any = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.logprobs = logprobs
        self.transport = transport  # an httpx transport (tests: httpx.ASGITransport(app))
        self.client: Any = None  # an httpx.AsyncClient while a run is open

    async def open(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits,
                                        transport=self.transport)

    async def model_name(self) -> str:
        if self.model is None:
            response = await self.client.get(f"{self.url}/v1/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        return self.model

    async def send(self, request: WorkloadRequest, on_tokens: OnTokens) -> tuple[int, str]:
        body: dict[str, Any] = {
            "model": await self.model_name(), "prompt": request.prompt,
            "max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
        if self.logprobs:
            body["logprobs"] = 0
        seen, reason, usage = 0, "none", None
        async with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    logprobs = choice.get("logprobs")
                    count = (len(logprobs["tokens"]) if logprobs
                             else int(bool(choice.get("text"))))
                    if count:
                        seen += count
                        on_tokens(count)
                    reason = choice.get("finish_reason") or reason
        if usage and usage.get("completion_tokens", seen) > seen:  # tokens that sent no text
            on_tokens(usage["completion_tokens"] - seen)
            seen = usage["completion_tokens"]
        return seen, reason

    async def close(self) -> None:
        await self.client.aclose()
        self.client = None


# ----------------------------------------------------------------------------- one run

@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds after the start of the run."""

    index: int
    prompt_len: int
    output_len: int  # asked for
    arrival: float  # scheduled
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish: float | None = None
    num_output: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None and self.num_output > 0


async def run_requests(backend: Backend, requests: Sequence[WorkloadRequest]
                       ) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time, concurrently; return the records and the
    run's duration (first arrival to last finish)."""
    start = 0.0  # set just before the first request goes
    records = [RequestRecord(r.index, r.prompt_len, r.output_len, r.arrival) for r in requests]

    async def one(request: WorkloadRequest, record: RequestRecord) -> None:
        delay = start + request.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

        def on_tokens(count: int) -> None:
            now = time.perf_counter() - start
            record.token_times.extend([now] * count)

        try:
            record.num_output, record.finish_reason = await backend.send(request, on_tokens)
        except Exception as exc:  # noqa: BLE001  (a failed request is reported, not fatal)
            record.error = f"{type(exc).__name__}: {exc}"
        record.finish = time.perf_counter() - start

    await backend.open()
    try:
        start = time.perf_counter()
        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records)))
        return records, time.perf_counter() - start
    finally:
        await backend.close()


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()),
            **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Throughputs and latency percentiles (seconds) over the finished requests."""
    done = [r for r in records if r.ok]
    values: dict[str, list[float]] = {name: [] for name in METRICS}
    for r in done:
        latency = r.finish - r.arrival
        ttft = r.token_times[0] - r.arrival
        values["ttft"].append(ttft)
        values["latency"].append(latency)
        values["norm_latency"].append(latency / r.num_output)
        if r.num_output > 1:
            values["tpot"].append((r.token_times[-1] - r.token_times[0]) / (r.num_output - 1))
        values["itl"].extend(np.diff(r.token_times).tolist())
    num_output = sum(r.num_output for r in done)
    return {
        "num_requests": len(records), "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": num_output / duration,
        "total_token_throughput": (num_output + sum(r.prompt_len for r in done)) / duration,
        "num_prompt_tokens": sum(r.prompt_len for r in done), "num_output_tokens": num_output,
        **{name: percentiles(v) for name, v in values.items()},
    }


class OtherCpu:
    """CPU time used by other processes while a run lasts, in cores (Linux ``/proc``; None
    elsewhere): how noisy a measurement on a shared machine was. In HTTP mode the server is one
    of the others."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                mine = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # - idle, iowait
        return time.monotonic(), busy, int(mine[11]) + int(mine[12])  # utime + stime

    def cores(self) -> float | None:
        end = self._read()
        if end is None or self._start is None or end[0] <= self._start[0]:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(others, 0) / ticks / (end[0] - self._start[0])


def measure(backend: Backend, spec: WorkloadSpec, num_requests: int, rate: float,
            seed: int = 0) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One point: run the stream for ``(spec, num_requests, rate, seed)`` and summarize it."""
    requests = make_requests(spec, num_requests, rate, seed)
    monitor = OtherCpu()
    records, duration = asyncio.run(run_requests(backend, requests))
    summary = summarize(records, duration)
    return {"rate": rate, **summary, "other_cpu": monitor.cores()}, records


def warmup(backend: Backend, spec: WorkloadSpec, num_requests: int = 2) -> None:
    """A few short requests first, so one-time costs (allocations, thread pools) don't count."""
    short = dataclasses.replace(spec, kind="orca", prompt_len=(16, 64), output_len=(4, 8))
    asyncio.run(run_requests(backend, make_requests(short, num_requests, math.inf, seed=12345)))


# ----------------------------------------------------------------------------- output

def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(points: Sequence[dict[str, Any]], label: str = "") -> str:
    """One row per point: throughputs, p50/p90/p99 of each latency metric (ms), and the cores
    other processes used meanwhile (``others``: noise on a shared machine)."""
    lines = [f"{'':<9}{'rate':>7}{'done':>7}{'req/s':>8}{'out tok/s':>10}"
             + "".join(f"{name + ' p50/90/99 ms':>27}" for name in METRICS) + "  others"]
    for p in points:
        cells = "".join(f"{'/'.join(_ms(p[name][f'p{q}']) for q in PERCENTILES):>27}"
                        for name in METRICS)
        done = f"{p['completed']}/{p['num_requests']}"
        lines.append(f"{p.get('policy', label):<9}{p['rate']:>7.2f}{done:>7}"
                     f"{p['request_throughput']:>8.2f}{p['output_throughput']:>10.1f}{cells}"
                     f"{_cores(p.get('other_cpu')):>8}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _plain(value: Any) -> Any:
    """Strict JSON: infinite floats as "inf"/"-inf" strings, NaN as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_json(path: str, record: dict[str, Any]) -> None:
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_plain(record), indent=1, default=str, allow_nan=False))
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- CLI

def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     quick: dict[str, Any]) -> argparse.Namespace:
    """``parser``'s arguments, with ``quick`` as the defaults when ``--quick`` is given (flags
    given explicitly still win)."""
    first, _ = parser.parse_known_args(argv)
    if first.quick:
        parser.set_defaults(**quick)
    return parser.parse_args(argv)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("orca", "sharegpt"), default="orca")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512],
                        metavar=("MIN", "MAX"), help="orca workload: prompt ~ U[MIN, MAX]")
    parser.add_argument("--output-len", type=int, nargs=2, default=[1, 128],
                        metavar=("MIN", "MAX"), help="orca workload: output ~ U[MIN, MAX]")
    parser.add_argument("--seed", type=int, default=0)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="default: max-batch-size of the longest possible request")
    parser.add_argument("--block-size", type=int, default=16)


def engine_kwargs(args: argparse.Namespace, spec: WorkloadSpec) -> dict[str, Any]:
    """``EngineConfig`` keywords: the KV cache holds max_batch_size of the longest requests, so
    the batch size, not memory, bounds every policy (as in bench/engine.py); no prefix cache."""
    longest = (spec.prompt_len[1] + spec.output_len[1] if spec.kind == "orca"
               else spec.max_model_len)
    longest = min(longest, spec.max_model_len)
    # No prefix cache: a sweep sends the same streams to one engine at each rate, and the
    # request-level baseline cannot cache (bench/prefix.py measures the cache).
    return {"max_batch_size": args.max_batch_size, "block_size": args.block_size,
            "kv_cache_tokens": args.kv_cache_tokens or args.max_batch_size * longest,
            "enable_prefix_caching": False}


def spec_for_model(args: argparse.Namespace, loaded: Any | None,
                   prompt_kind: str = "ids") -> WorkloadSpec:
    """The workload for a loaded model (its vocabulary and context), or for a server's."""
    if loaded is None:
        return WorkloadSpec(args.workload, tuple(args.prompt_len), tuple(args.output_len),
                            args.max_model_len, args.vocab_size, tuple(args.special_ids),
                            prompt_kind)
    return WorkloadSpec(args.workload, tuple(args.prompt_len), tuple(args.output_len),
                        loaded.info.max_model_len, loaded.config.vocab_size,
                        tuple(loaded.info.eos_token_ids), prompt_kind)


def load(args: argparse.Namespace) -> Any:
    import torch

    from orca_ext.model import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return load_model(args.model, args.dtype, device)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("inproc", "http"), default="inproc")
    parser.add_argument("--rate", type=float, nargs="+", default=[1.0],
                        help="requests/s; several for a sweep; inf sends all at once")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--policy", choices=("orca", "paged", "request"), default="orca",
                        help="inproc: the scheduling policy")
    add_workload_args(parser)
    add_engine_args(parser)
    http = parser.add_argument_group("http backend")
    http.add_argument("--url", default="http://127.0.0.1:8000")
    http.add_argument("--served-model", default=None, help="default: the first of /v1/models")
    http.add_argument("--prompt-kind", choices=("ids", "text"), default="ids")
    http.add_argument("--vocab-size", type=int, default=256, help="token ids drawn below it")
    http.add_argument("--special-ids", type=int, nargs="*", default=[])
    http.add_argument("--max-model-len", type=int, default=1024)
    http.add_argument("--no-logprobs", action="store_true",
                      help="don't ask for logprobs (then tokens are counted by text chunks)")
    parser.add_argument("--json", default=None, help="write the JSON record here")
    args = parser.parse_args(argv)

    engine = None
    if args.backend == "inproc":
        from orca_ext.async_engine import AsyncEngine
        from orca_ext import EngineConfig, build_engine

        loaded = load(args)
        spec = spec_for_model(args, loaded)
        engine = AsyncEngine(build_engine(EngineConfig(loaded, policy=args.policy,
                                                       **engine_kwargs(args, spec))))
        backend: Backend = InProcessBackend(engine)
        label = args.policy
    else:
        spec = spec_for_model(args, None, args.prompt_kind)
        backend = HTTPBackend(args.url, args.served_model, logprobs=not args.no_logprobs)
        label = "http"
    warmup(backend, spec)
    points = []
    for rate in args.rate:
        point, _ = measure(backend, spec, args.num_requests, rate, args.seed)
        point["policy"] = label
        points.append(point)
        print(format_table([point]).splitlines()[-1], flush=True)
    print()
    print(format_table(points))
    if engine is not None:
        engine.shutdown()
    if args.json:
        write_json(args.json, {"benchmark": "serving", "args": vars(args),
                               "workload": dataclasses.asdict(spec),
                               "environment": environment(), "points": points})


if __name__ == "__main__":
    sys.exit(main())
