"""Timing shared by the benchmarks: interleaved repeats and paired ratios (the Method of
jaxdp/bench/__init__.py)."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each case: `repeats` rounds, every case once per round, in an order
    that rotates from round to round (the case run first after another one may find caches cold)."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no case always first
                times[name].append(timed(cases[name]))
    finally:
        gc.enable()
    return times


def paired_ratio(times: list[float], baseline: list[float]) -> float:
    """Median over repeats of time / baseline time in the same repeat (both ran back to back, so
    a load change that slows one repeat divides out)."""
    return statistics.median(t / b for t, b in zip(times, baseline, strict=True))
