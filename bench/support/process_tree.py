"""What a process tree costs while a block runs: peak RSS/PSS, CPU cores, and the rest of the machine's CPU.

Read from /proc (Linux): the measuring process and all its descendants (a Ray
cluster it started included).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def _tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def _rss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def _pss_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _pid_cpu_seconds(pid: int) -> float:
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def proc_figure(field: str, file: str = "status") -> int:
    """A figure of /proc/self/status, in kB: ``VmRSS`` now, ``VmHWM`` the peak of this program's memory (not
    ``ru_maxrss``: Linux carries the parent's RSS at the fork into a child across ``exec``); or of another
    file of /proc/self, in its unit (``io``'s ``rchar``: the bytes this process read)."""
    for line in Path(f"/proc/self/{file}").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/{file}")


def _machine_busy_seconds() -> float:
    """CPU-seconds all processes on this machine have used since boot (all cores)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def watch_tree(interval_s: float = 0.5, sample: bool = True) -> Iterator[dict[str, float]]:
    """While the block runs: peak summed RSS and PSS (MB) of this process and its descendants, the CPU they
    used (in cores, on average) and what the rest of the machine used meanwhile. ``sample=False``: CPU only,
    read at the start and the end (no sampling thread competing with a single-process measurement)."""
    figures = {"rss_mb": 0.0, "pss_mb": 0.0, "processes": 0.0, "cores": 0.0, "others_cores": 0.0}
    first_cpu = {p: _pid_cpu_seconds(p) for p in _tree_pids(os.getpid())}
    last_cpu = dict(first_cpu)
    stop = threading.Event()

    def take_samples() -> None:
        while True:
            pids = _tree_pids(os.getpid())
            figures["rss_mb"] = max(figures["rss_mb"], sum(_rss_bytes(p) for p in pids) / 2**20)
            figures["pss_mb"] = max(figures["pss_mb"], sum(_pss_bytes(p) for p in pids) / 2**20)
            figures["processes"] = max(figures["processes"], len(pids))
            last_cpu.update({p: _pid_cpu_seconds(p) for p in pids})  # exited processes keep their last reading
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=take_samples, daemon=True)
    began, busy_before = time.perf_counter(), _machine_busy_seconds()
    if sample:
        thread.start()
    try:
        yield figures
    finally:
        stop.set()
        if sample:
            thread.join()
        else:
            last_cpu.update({p: _pid_cpu_seconds(p) for p in _tree_pids(os.getpid())})
        wall = time.perf_counter() - began
        ours = sum(cpu - first_cpu.get(pid, 0.0) for pid, cpu in last_cpu.items())
        figures["cores"] = ours / wall
        figures["others_cores"] = max(0.0, (_machine_busy_seconds() - busy_before - ours) / wall)


def wait_until_idle(max_wait_s: float = 30.0, below_cores: float = 0.25) -> float:
    """Wait until this process tree uses < ``below_cores`` CPU over a second; returns seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait_s:
        pids = _tree_pids(os.getpid())
        before = sum(map(_pid_cpu_seconds, pids))
        time.sleep(1.0)
        if sum(map(_pid_cpu_seconds, pids)) - before < below_cores:
            break
    return time.perf_counter() - started
