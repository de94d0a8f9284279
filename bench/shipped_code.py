"""Shipped factory code: what verifying it on every use costs, kept as a zip against unpacked.

Zips an installed package's sources as ``register-model --code`` does, then times, best of ``--repeats``:
hashing the zip (what every load of a version's code does), hashing the same files unpacked, compiling
every source (the most importing from the zip pays over cached bytecode); and, median of ``--imports``
fresh processes each, importing the package from the zip and from the unpacked folder with its bytecode
cached. Prints each figure, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support.results import emit  # noqa: E402
from bench.support.timing import run_seconds  # noqa: E402
from rayline.ray_workloads.architectures.factory_models import zip_code  # noqa: E402

IMPORT = (
    "import sys, time; sys.path.insert(0, sys.argv[1]); import torch; started = time.perf_counter(); "
    "module = __import__(sys.argv[2]); assert module.__file__.startswith(sys.argv[1]), module.__file__; "
    "print(time.perf_counter() - started)"
)


def _tree_digests(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _compile_all(folder: Path) -> None:
    for path in folder.rglob("*.py"):
        compile(path.read_bytes(), str(path), "exec")


def _import_s(entry: Path, package: str) -> float:
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT, str(entry), package], env=env, cwd="/", capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="timm", help="an installed package whose sources stand for the code")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--imports", type=int, default=3)
    args = parser.parse_args()
    installed = Path(__import__(args.package).__file__).parent
    with tempfile.TemporaryDirectory() as work:
        source = Path(work, "source", args.package)
        shutil.copytree(installed, source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        archive = Path(work, "code.zip")
        archive.write_bytes(zip_code(str(source), args.package))
        unpacked = Path(work, "unpacked")
        with zipfile.ZipFile(archive) as opened:
            opened.extractall(unpacked)
            files = len(opened.namelist())
        zip_ms = min(run_seconds(lambda: hashlib.sha256(archive.read_bytes()).hexdigest(), args.repeats)) * 1e3
        tree_ms = min(run_seconds(lambda: _tree_digests(unpacked), args.repeats)) * 1e3
        compile_ms = min(run_seconds(lambda: _compile_all(unpacked), min(args.repeats, 3))) * 1e3
        _import_s(unpacked, args.package)  # writes the bytecode the folder's later imports read
        from_zip, from_folder = [], []
        for _ in range(args.imports):
            from_zip.append(_import_s(archive, args.package))
            from_folder.append(_import_s(unpacked, args.package))
        result = {
            "package": args.package,
            "files": files,
            "zip_mb": round(archive.stat().st_size / 1e6, 2),
            "zip_sha256_ms": round(zip_ms, 1),
            "tree_sha256_ms": round(tree_ms, 1),
            "compile_sources_s": round(compile_ms / 1e3, 2),
            "import_from_zip_s": round(statistics.median(from_zip), 2),
            "import_from_folder_with_bytecode_s": round(statistics.median(from_folder), 2),
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
    for key, value in result.items():
        print(f"{key}: {value}")
    emit("shipped_code", result)


if __name__ == "__main__":
    main()
