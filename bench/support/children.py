"""Measurements in child processes: each gets a fresh interpreter, its own Ray cluster and its own memory.

A child prints its figures as one ``RESULT`` line; the parent runs it, echoes nothing else unless asked,
and on a failure shows the child's output and stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

RESULT = "BENCH-RESULT "


def print_result(figures: dict[str, Any]) -> None:
    print(RESULT + json.dumps(figures), flush=True)


def work_dir(prefix: str) -> str:
    """A fresh folder under /tmp with a short path: Ray's socket paths live under it."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def child_env(work: str) -> dict[str, str]:
    """This environment without another cluster's or storage's settings; rayline's storage and Ray's files
    under ``work``, so that they go away with it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYLINE_", "RAY_ADDRESS", "PREFECT_API_URL"))}
    return env | {"RAYLINE_STORAGE": work, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": work}


def parse_result(label: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if returncode != 0 or not lines:
        sys.stderr.write(stdout[-4000:] + stderr[-4000:])
        raise SystemExit(f"{label} failed (exit {returncode})")
    return dict(json.loads(lines[-1][len(RESULT) :]))


def run_child(
    label: str, script: str, args: list[str], env: dict[str, str] | None = None, echo: bool = False
) -> dict[str, Any]:
    """``script args`` in a fresh interpreter: its ``RESULT``; ``echo`` prints its other lines."""
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, check=False)
    if echo:
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith(RESULT)), flush=True)
    return parse_result(label, proc.returncode, proc.stdout, proc.stderr)
