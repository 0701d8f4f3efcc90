"""The live dashboard's feed (``GET /dashboard/events``): server-sent events sampled from the
engine's activity record a few times a second, only while at least one dashboard is connected.

One sampler task serves every connected dashboard: each tick it copies what the engine recorded
since the last tick (``Engine.activity_sample``, one short hold of the engine's lock), reads the
latency histograms that ``/metrics`` exports, encodes one JSON message and queues it for every
client. A client first gets a ``hello`` event (the configuration and all the record keeps), then
a ``sample`` event per tick; records are numbered, so it drops the ones it has already seen.
The engine loop itself does nothing for the dashboard beyond keeping its record.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram

from ..activity import ActivitySample
from ..engine import EngineStats

if TYPE_CHECKING:
    from .core import ServingCore

SAMPLE_INTERVAL = 0.25  # seconds between samples
RATE_WINDOW = 5.0  # seconds over which tokens/s is measured
LATENCY_WINDOW = 30.0  # seconds over which the recent TTFT and inter-token latency are averaged
QUEUE_LENGTH = 32  # samples a slow client may lag behind before it is dropped (it reconnects)


class DashboardFeed:
    def __init__(self, core: ServingCore, interval: float = SAMPLE_INTERVAL) -> None:
        self.core = core
        self.interval = interval
        self._clients: set[asyncio.Queue[str | None]] = set()
        self._sampler: asyncio.Task | None = None
        self._cursors = (-1, -1)  # the newest iteration and event numbers already sent
        # (time, generated tokens, TTFT sum, TTFT count, ITL sum, ITL count) per tick.
        self._totals: deque[tuple[float, int, float, float, float, float]] = deque()

    def config(self) -> dict[str, Any]:
        """What the dashboard shows of the engine's set-up."""
        engine = self.core.engine.engine
        scheduler = engine.scheduler
        config = scheduler.config
        return {
            "model": self.core.model_name, "max_model_len": engine.info.max_model_len,
            "policy": config.policy, "max_batch_size": config.max_batch_size,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_batches_in_flight": config.num_batches_in_flight,
            "enable_prefix_caching": config.enable_prefix_caching,
            "block_size": scheduler.allocator.block_size,
            "num_blocks": scheduler.allocator.num_blocks,
            "sample_interval": self.interval,
        }

    async def events(self) -> AsyncIterator[str]:
        """One client's server-sent events; it ends early if the client falls too far behind."""
        queue: asyncio.Queue[str | None] = asyncio.Queue(QUEUE_LENGTH)
        sample, stats = self.core.engine.engine.activity_sample()
        if self._sampler is None:
            self._cursors = (sample.last_iteration, sample.last_event)
            self._totals.clear()
        hello = {"config": self.config(), **self._message(sample, stats, time.time())}
        self._clients.add(queue)
        if self._sampler is None:
            self._sampler = asyncio.ensure_future(self._sample_while_watched())
        try:
            yield _event("hello", hello)
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._clients.discard(queue)
            if not self._clients and self._sampler is not None:
                self._sampler.cancel()
                self._sampler = None

    async def _sample_while_watched(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            sample, stats = self.core.engine.engine.activity_sample(*self._cursors)
            self._cursors = (sample.last_iteration, sample.last_event)
            item = _event("sample", self._message(sample, stats, time.time()))
            for queue in list(self._clients):
                if queue.full():  # it stopped reading: end its stream, it reconnects
                    self._clients.discard(queue)
                    queue.get_nowait()
                    queue.put_nowait(None)
                else:
                    queue.put_nowait(item)

    def _message(self, sample: ActivitySample, stats: EngineStats, now: float
                 ) -> dict[str, Any]:
        return {
            "time": now, "healthy": self.core.engine.is_healthy(),
            "iterations": [[i.number, i.start, i.end, i.entries] for i in sample.iterations],
            "events": sample.events,
            "live": [[s.sequence_id, s.label, s.state, s.num_prompt_tokens, s.num_output_tokens,
                      s.arrival_time] for s in sample.live],
            "stats": {
                "waiting": stats.num_waiting, "running": stats.num_running,
                "requests": stats.num_requests,
                "batches_in_flight": stats.num_batches_in_flight,
                "used_blocks": stats.num_used_blocks, "total_blocks": stats.num_blocks,
                "cached_blocks": stats.num_cached_blocks,
                "evictable_blocks": stats.num_evictable_blocks,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "preemptions": stats.num_preemptions,
                "generated_tokens": stats.num_generated_tokens,
                "iterations": stats.num_iterations,
            },
            "rates": self._rates(stats, now),
        }

    def _rates(self, stats: EngineStats, now: float) -> dict[str, float | None]:
        """Tokens/s over the last RATE_WINDOW seconds; mean TTFT and inter-token latency over
        the requests that ended in the last LATENCY_WINDOW seconds and since start, from the
        histograms ``/metrics`` exports (None: no data)."""
        metrics = self.core.metrics
        ttft_sum, ttft_count = _totals(metrics.ttft)
        itl_sum, itl_count = _totals(metrics.tpot)
        totals = self._totals
        totals.append((now, stats.num_generated_tokens, ttft_sum, ttft_count, itl_sum,
                       itl_count))
        while totals[0][0] < now - LATENCY_WINDOW:
            totals.popleft()
        rate_from = next(t for t in totals if t[0] >= now - RATE_WINDOW)
        elapsed = now - rate_from[0]
        latency_from = totals[0]
        return {
            "tokens_per_s": (stats.num_generated_tokens - rate_from[1]) / elapsed
            if elapsed > 0 else None,
            "ttft_s": _mean(ttft_sum - latency_from[2], ttft_count - latency_from[3]),
            "itl_s": _mean(itl_sum - latency_from[4], itl_count - latency_from[5]),
            "ttft_mean_s": _mean(ttft_sum, ttft_count),
            "itl_mean_s": _mean(itl_sum, itl_count),
        }


def _totals(histogram: Histogram) -> tuple[float, float]:
    """A histogram's (sum, count)."""
    values = {s.name.rpartition("_")[2]: s.value for s in histogram.collect()[0].samples
              if s.name.endswith(("_sum", "_count"))}
    return values["sum"], values["count"]


def _mean(total: float, count: float) -> float | None:
    return total / count if count else None


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
