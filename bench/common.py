"""Helpers shared by the benchmarks: medians of repeated runs in the same process, and plots
(matplotlib, the ``bench`` extra)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

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


def pyplot(paths: Sequence[Path]) -> Any | None:
    """matplotlib's pyplot drawing to files only, or None (and a note naming ``paths``) when
    matplotlib is not installed: a benchmark's tables and JSON are its results, plots extra."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install 'orca_ext[bench]', then run "
              f"again for {', '.join(map(str, paths))})")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, paths: Sequence[Path]) -> None:
    """Write ``figure`` to each PNG path, then free it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=90)
        print(f"wrote {path}")
    plt.close(figure)
