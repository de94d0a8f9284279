"""A bench's last line of JSON, and the result file that docs/ quotes it from.

Every bench ends with one line of JSON. With ``RAYLINE_BENCH_RESULTS`` set to a folder (``bench/results``
in a checkout), the same figures are also written there as ``<bench>-<date>-<machine>.json`` with the
command, the machine and the date: a page quotes a figure from that file, naming its key, and
tests/unit/test_doc_figures.py checks the quote against it (bench/results/README.md).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS_VARIABLE = "RAYLINE_BENCH_RESULTS"
FIELDS = ("bench", "command", "machine", "date", "figures")


def machine() -> str:
    """The CPU model, its cores and plan-relevant instruction sets, and the GPU where the bench loaded torch
    and it sees one: what the figures depend on. torch is not imported for it (a storage bench has none)."""
    from rayline.hardware import cpu

    model, isa = cpu()
    named = f"{model}, {os.cpu_count()} cores, {', '.join(isa) or 'no AVX2'}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        named += f", {torch.cuda.get_device_name(0)}"
    return named


def slug(text: str, limit: int = 40) -> str:
    """A file-name part of ``text``: lower case, runs of anything else than letters and digits as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")


def command() -> str:
    """The command line as run from the repository root: the interpreter relative to it where it is inside."""
    python = os.path.relpath(sys.executable)
    return shlex.join([sys.executable if python.startswith("..") else python, *sys.argv])


def record(bench: str, figures: dict[str, Any]) -> dict[str, Any]:
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    return {"bench": bench, "command": command(), "machine": machine(), "date": today, "figures": figures}


def save(folder: Path, result: dict[str, Any]) -> Path:
    """``result`` as ``<bench>-<date>-<machine>.json`` in ``folder``, ``-2``, ``-3``… for the day's next runs on
    that machine: a page may quote the earlier one, which must stay as it was."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{result['bench']}-{result['date']}-{slug(result['machine'])}"
    path, run = folder / f"{stem}.json", 1
    while path.exists():
        run += 1
        path = folder / f"{stem}-{run}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def emit(bench: str, figures: dict[str, Any]) -> None:
    """The bench's last line, ``figures`` as JSON; and its result file where ``RAYLINE_BENCH_RESULTS`` names a
    folder (said on stderr, so that stdout still ends with the JSON line)."""
    print(json.dumps(figures), flush=True)
    folder = os.environ.get(RESULTS_VARIABLE)
    if folder:
        print(f"result file: {save(Path(folder), record(bench, figures))}", file=sys.stderr)
