"""The node-loss drills' cluster: a head and a worker node of this machine's, started and stopped by PID.

The head is `ray start --head`, the worker node `ray start --address=HEAD` with its own CPUs and
ports. :func:`killed_midway` runs a stage while the worker node's raylet is SIGKILLed once the
stage's work runs there, and launches the worker node that replaces it.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import ray
from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

from rayline import ray_cluster
from tests.support import free_port, node_port_flags, pids_mentioning, start_ray_head, stop_process, wait_for_port

BIN = Path(sys.executable).parent
# The GCS declares a silent node dead after period × threshold (default 3 s × 5): shorter here.
_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


def _parent(pid: int) -> int:
    """The parent's PID, or 0 for a process gone."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _children(pid: int) -> list[int]:
    return [
        int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit() and _parent(int(entry.name)) == pid
    ]


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class TwoNodes:
    """A head and one worker node of our own; the worker node can be killed and replaced."""

    def __init__(self, temp_dir: str, address: str) -> None:
        self.temp_dir = temp_dir
        self.address = address
        self.worker: subprocess.Popen[bytes] | None = None
        self.node_manager_port = 0
        self.killed_at = 0.0  # unix time of the last kill
        self.joined = False  # whether the worker node last launched is alive in the cluster
        self.spare: tuple[subprocess.Popen[bytes], int, float] | None = None  # process, port, launched at
        self.launched_at = 0.0  # monotonic time of that launch
        # a drill whose stage never finished: its thread still calls Ray in this process, so leaving the
        # cluster would let it join again by itself and die with the cluster's stop (Ray ends a driver
        # whose GCS is gone: no report of the rest of the session). Such a cluster stops at exit instead.
        self.stuck = False

    def start_worker(self) -> None:
        self.launch_worker()
        self.wait_for_worker()

    def launch_worker(self) -> None:
        """Start a worker node's ``ray start`` without waiting for it to join (:meth:`wait_for_worker`)."""
        self.worker, self.node_manager_port = self._launch()
        self.joined = False
        self.launched_at = time.monotonic()

    def launch_spare(self) -> None:
        """Start the next worker node while this one runs; it is the worker node once this one is killed."""
        self.spare = (*self._launch(), time.monotonic())

    def _launch(self) -> tuple[subprocess.Popen[bytes], int]:
        ports = node_port_flags()
        args = [
            str(BIN / "ray"), "start", f"--address={self.address}", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", "--num-cpus=4", *ports,
            "--min-worker-port=21000", "--max-worker-port=21999",
        ]  # fmt: skip
        proc = subprocess.Popen(args, env=_cluster_env(), cwd=self.temp_dir, start_new_session=True)
        return proc, int(ports[0].split("=")[1])

    def wait_for_worker(self) -> None:
        """Until the launched worker node is alive in the cluster (at once when it already joined)."""
        if not self.joined:
            assert self.worker is not None
            self.worker, self.node_manager_port = self._join(self.worker, self.node_manager_port, self.launched_at)
            self.joined = True

    def wait_for_spare(self) -> None:
        assert self.spare is not None
        proc, port, launched_at = self.spare
        self.spare = (*self._join(proc, port, launched_at), launched_at)

    def _join(
        self, proc: subprocess.Popen[bytes], port: int, launched_at: float
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Until the node of ``proc`` (its raylet on ``port``) is alive in the cluster; that node's process and port.

        On a loaded machine a node's start can fail by itself: its raylet gives up waiting for the
        node's dashboard agent and `ray start` exits ("The current node timed out during startup"; seen
        under a load of 14-21 on 2 cores, as well before these drills overlapped anything). Such a start
        is started again, twice at most: that is the test's machinery, not the recovery under test.
        """
        # `ray start` takes seconds, but over a minute on a 2-core machine loaded by other suites (seen)
        deadline = launched_at + 180
        relaunches = 2
        while not any(n["Alive"] and n["NodeManagerPort"] == port for n in ray.nodes()):  # type: ignore[no-untyped-call]
            if proc.poll() is not None and relaunches > 0:
                stop_process(proc, timeout_s=30)  # what it left of its group
                (proc, port), relaunches, deadline = self._launch(), relaunches - 1, time.monotonic() + 180
            assert time.monotonic() < deadline and proc.poll() is None, "the worker node did not join"
            time.sleep(0.2)
        return proc, port

    def raylet_pid(self) -> int:
        marker = f"--node_manager_port={self.node_manager_port}"
        found = [p for p in pids_mentioning(marker) if "raylet" in _cmdline(p).split(" ")[0]]
        # a child the raylet is forking to start a worker carries the raylet's command line until it execs
        # (seen while ingest's shard tasks started): the raylet is the one whose parent is none of them
        (pid,) = [p for p in found if _parent(p) not in found]
        return pid

    def wait_until_running(self, title: str, timeout_s: float = 120.0) -> None:
        """Until a worker process of the worker node runs ``title`` (Ray titles a busy worker ``ray::<name>``)."""
        raylet = self.raylet_pid()
        deadline = time.monotonic() + timeout_s
        while not any(title in _cmdline(p) for p in _children(raylet)):
            assert time.monotonic() < deadline, f"no {title} ran on the worker node"
            time.sleep(0.05)

    def kill_worker_node(self) -> None:
        """SIGKILL the worker node's raylet, then reap what is left of that node; start a fresh one."""
        os.kill(self.raylet_pid(), 9)
        self.killed_at = time.time()
        assert self.worker is not None
        stop_process(self.worker, timeout_s=30)
        if self.spare is not None:
            self.worker, self.node_manager_port, self.launched_at = self.spare
            self.spare, self.joined = None, False

    def stop_worker(self) -> None:
        for proc in (self.worker, self.spare[0] if self.spare is not None else None):
            if proc is not None:
                stop_process(proc, timeout_s=30)


def _cluster_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


@contextmanager
def two_node_cluster() -> Iterator[TwoNodes]:
    """The module's cluster, this process connected to it; the embedded one rejoined after (when it was)."""
    rejoin = ray.is_initialized()
    ray_cluster.disconnect()  # this process may join one cluster at a time
    temp_dir = tempfile.mkdtemp(prefix="rl-nl-", dir="/tmp")  # short: unix socket paths are limited
    port = free_port()
    env = _cluster_env()
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "2"
    args = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
        f"--temp-dir={temp_dir}", f"--system-config={json.dumps(_SYSTEM_CONFIG)}",
        "--min-worker-port=20000", "--max-worker-port=20999",
    ]  # fmt: skip
    head = start_ray_head(lambda: [*args, *node_port_flags()], env, Path(temp_dir))
    cluster = TwoNodes(temp_dir, f"127.0.0.1:{port}")
    try:
        wait_for_port(port)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_ADDRESS", cluster.address)
            # the head made its token (~/.ray/auth_token); this process sends it, as a new embedded cluster would
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
            ray_cluster.connect()
            cluster.start_worker()
            yield cluster
            if cluster.stuck:
                atexit.register(_stop_cluster, cluster, head)
                return
            ray_cluster.disconnect()
    finally:
        if not cluster.stuck:
            _stop_cluster(cluster, head)
    if rejoin:
        ray_cluster.connect()


def _stop_cluster(cluster: TwoNodes, head: subprocess.Popen[bytes]) -> None:
    """Stop both nodes by PID and check that nothing of theirs is left."""
    try:
        cluster.stop_worker()
    finally:
        stop_process(head, timeout_s=60)
    deadline = time.monotonic() + 30
    while pids_mentioning(cluster.temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pids_mentioning(cluster.temp_dir) == [], "processes of the 2-node cluster survived its stop"


def killed_midway(
    cluster: TwoNodes,
    title: str,
    stage: Callable[[], Any],
    ready: Callable[[], bool] | None = None,
    replace_at_once: bool = False,
) -> Any:
    """Run ``stage`` while the worker node is killed once ``title`` runs there (and ``ready()`` holds);
    its result. A fresh worker node joins once the stage is over, or right after the kill with
    ``replace_at_once`` (for a stage that waits for the resources only that node has)."""
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["result"] = stage()
        except BaseException as exc:
            outcome["error"] = exc

    cluster.wait_for_worker()  # the replacement launched after the previous drill
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    killed = False
    try:
        _wait_until_ready_for_the_kill(cluster, title, driver, ready)
        cluster.kill_worker_node()
        killed = True
        if replace_at_once:
            cluster.start_worker()
    finally:
        driver.join(timeout=300)  # on any failure too: a stage left running would call Ray after the module
        if driver.is_alive():
            cluster.stuck = True
            frame = sys._current_frames().get(driver.ident or 0)
            where = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
            raise AssertionError(f"the stage did not finish after the node loss; it waits in:\n{where}")
        if killed and not replace_at_once:
            # a fresh worker node for the next drill, which waits for it to join (meanwhile: checks, seeding)
            cluster.launch_worker()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _wait_until_ready_for_the_kill(
    cluster: TwoNodes, title: str, driver: threading.Thread, ready: Callable[[], bool] | None
) -> None:
    cluster.wait_until_running(title)
    deadline = time.monotonic() + 120
    while ready is not None and not ready():
        assert time.monotonic() < deadline and driver.is_alive(), "the stage never got ready for the kill"
        time.sleep(0.1)
    assert driver.is_alive(), "the stage ended before the kill"
