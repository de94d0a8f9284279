"""A call timed again and again: the seconds of each run, for a bench to take their median or best."""

from __future__ import annotations

import time
from collections.abc import Callable


def run_seconds(work: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``work``, one after another."""
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - began)
    return seconds
