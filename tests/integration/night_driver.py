"""A batch-inference driver for a test to kill: it writes block files, then never reaches its commit.

``python -m tests.integration.night_driver '<InferenceConfig as JSON>' <run id>``

Runs ``rayline.ray_workloads.nightly.batch_inference.run`` in this process on the cluster of
``RAY_ADDRESS``, or on an embedded cluster of its own when that is unset, with
a predictor that writes ``RAYLINE_TEST_STALL_AFTER`` blocks (default 1) like
the real one, counted per actor, and then stalls before the next one. So the
test that kills this process knows where it stands once that many block
files appear: after the actors wrote them, before the driver committed,
without racing the commit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rayline import ray_cluster
from rayline.ray_workloads.nightly import batch_inference
from rayline.ray_workloads.nightly.blocks import BlockReport
from rayline.ray_workloads.nightly.predictor import PredictorUDF
from rayline.tables.delta_tables import Night
from tests.support import REPO_ROOT


class StallingPredictor(PredictorUDF):
    """The batch-inference UDF, except that it stalls for good once it has written its blocks."""

    written = 0

    def run_block(self, block: str, uris: list[str], etags: list[str]) -> BlockReport:
        if self.written >= int(os.environ.get("RAYLINE_TEST_STALL_AFTER", "1")):
            threading.Event().wait()  # a night still being predicted: the driver waits for this block forever
        self.written += 1
        return super().run_block(block, uris, etags)


def _pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _stop_cluster_of(driver: subprocess.Popen[bytes], temp_dir: str) -> None:
    """End the killed driver's embedded Ray cluster: its process group, then stragglers by PID (its temp dir)."""
    try:
        os.killpg(driver.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    driver.wait(timeout=30)
    deadline = time.monotonic() + 30
    while (left := _pids_mentioning(temp_dir)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass(frozen=True)
class Driver:
    """A night's driver process (:func:`driver_process`) and the file its output goes to."""

    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def driver_process(config: batch_inference.InferenceConfig, run_id: str, stall_after: int = 1) -> Iterator[Driver]:
    """Run a night in a driver process (this module) on an embedded Ray cluster of its own; end it all at exit.

    Its predictor stalls after ``stall_after`` blocks per actor; killing or pausing the driver touches
    nothing of the session's cluster.
    """
    temp_dir = tempfile.mkdtemp(prefix="rl-kill-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = Path(temp_dir, "driver.log")
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.night_driver", config.model_dump_json(), run_id],
            cwd=REPO_ROOT,
            env={**env, "RAY_TMPDIR": temp_dir, "RAYLINE_TEST_STALL_AFTER": str(stall_after)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Driver(process, log)
    finally:
        _stop_cluster_of(process, temp_dir)


def wait_for_blocks(
    driver: Driver,
    config: batch_inference.InferenceConfig,
    run_id: str,
    written: Callable[[str, Night, str], dict[str, list[str]]],
    blocks: int,
) -> None:
    """Wait until the driver's actors wrote ``blocks`` block files (``written``: the files a run left)."""
    night = Night(config.model.name, config.dt)
    deadline = time.monotonic() + 300
    while len(_block_files(written(config.tables_root, night, run_id)["predictions"])) < blocks:
        assert driver.process.poll() is None, f"the driver exited ({driver.process.returncode}): {driver.output()}"
        assert time.monotonic() < deadline, f"fewer block files than asked after 300 s: {driver.output()}"
        time.sleep(0.1)


def kill_once_written(
    config: batch_inference.InferenceConfig,
    run_id: str,
    written: Callable[[str, Night, str], dict[str, list[str]]],
    blocks: int = 1,
) -> dict[str, list[str]]:
    """Run a night in a driver process (this module), SIGKILL it once its actors wrote ``blocks`` blocks.

    Its predictor stalls after ``blocks`` blocks, so the kill lands after writing and before the commit.
    ``written(root, night, run_id)`` lists the files the run left per table; what it lists after the kill
    is returned.
    """
    with driver_process(config, run_id, stall_after=blocks) as driver:
        wait_for_blocks(driver, config, run_id, written, blocks)
        os.kill(driver.process.pid, signal.SIGKILL)
        driver.process.wait(timeout=30)
    return written(config.tables_root, Night(config.model.name, config.dt), run_id)


def _block_files(paths: list[str]) -> list[str]:
    return [p for p in paths if "/blocks-" in p]


def main(argv: list[str]) -> None:
    config = batch_inference.InferenceConfig.model_validate_json(argv[0])
    ray_cluster.connect()
    # the module's global, which its map_batches call reads: only this process's run stalls
    batch_inference.PredictorUDF = StallingPredictor  # type: ignore[attr-defined]
    batch_inference.run(config, run_id=argv[1])
    raise SystemExit("the run committed: it was meant to stall before its commit")


if __name__ == "__main__":
    main(sys.argv[1:])
