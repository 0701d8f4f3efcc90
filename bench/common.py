"""Timing helpers shared by the benchmarks: medians of repeated runs, in the same process."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], device: str = "cpu", warmup: int = 3, min_runs: int = 5,
            min_seconds: float = 0.5) -> float:
    """Median seconds per call of ``fn``."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(name: str, ours: float, baseline: float, baseline_name: str) -> str:
    return (f"{name:<52} ours {ours * 1e3:9.3f} ms   {baseline_name} {baseline * 1e3:9.3f} ms"
            f"   speedup {baseline / ours:5.2f}x")
