"""Node loss drills on a real 2-node Ray cluster on this machine: the worker node's raylet is killed mid-stage.

One cluster for the module: a head (`ray start --head`) and a worker node
(`ray start --address=HEAD`) with its own CPUs and ports, both started and
stopped by PID. This process leaves the session's embedded cluster for it (a
process joins one cluster at a time) and rejoins an embedded one afterwards.
Each drill waits until the stage's work runs on the worker node, SIGKILLs that
node's raylet (its workers die with it), lets the stage finish with no retry by
the test, checks it wrote exactly one row per input, and starts a new worker
node for the next drill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

from ray_workloads import batch_inference, ingest
from rayline import ray_cluster, storage
from rayline.prediction_reads import read_night_pair
from rayline.seed import seed, seed_incoming
from tests.integration.helpers import register_untrained
from tests.support import free_port, pids_mentioning, stop_process, wait_for_port

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
# The GCS declares a silent node dead after period × threshold (default 3 s × 5): shorter here.
_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


def _ports() -> list[str]:
    return [
        f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
    ]  # fmt: skip


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


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

    def start_worker(self) -> None:
        ports = _ports()
        self.node_manager_port = int(ports[0].split("=")[1])
        args = [
            str(BIN / "ray"), "start", f"--address={self.address}", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", "--num-cpus=4", *ports,
            "--min-worker-port=21000", "--max-worker-port=21999",
        ]  # fmt: skip
        self.worker = subprocess.Popen(args, env=_cluster_env(), cwd=self.temp_dir, start_new_session=True)
        deadline = time.monotonic() + 60
        while not any(n["Alive"] and n["NodeManagerPort"] == self.node_manager_port for n in ray.nodes()):  # type: ignore[no-untyped-call]
            assert time.monotonic() < deadline, "the worker node did not join"
            time.sleep(0.2)

    def raylet_pid(self) -> int:
        marker = f"--node_manager_port={self.node_manager_port}"
        (pid,) = [p for p in pids_mentioning(marker) if "raylet" in _cmdline(p).split(" ")[0]]
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
        assert self.worker is not None
        stop_process(self.worker, timeout_s=30)

    def stop_worker(self) -> None:
        if self.worker is not None:
            stop_process(self.worker, timeout_s=30)


def _cluster_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


@pytest.fixture(scope="module")
def two_nodes(s3_endpoint: str) -> Iterator[TwoNodes]:
    rejoin = ray.is_initialized()
    ray_cluster.disconnect()  # this process may join one cluster at a time
    temp_dir = tempfile.mkdtemp(prefix="rl-nl-", dir="/tmp")  # short: unix socket paths are limited
    port = free_port()
    env = _cluster_env()
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "2"
    args = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
        f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port()}", *_ports(),
        f"--system-config={json.dumps(_SYSTEM_CONFIG)}",
        "--min-worker-port=20000", "--max-worker-port=20999",
    ]  # fmt: skip
    head = subprocess.Popen(args, env=env, cwd=temp_dir, start_new_session=True)
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
            ray_cluster.disconnect()
    finally:
        cluster.stop_worker()
        stop_process(head, timeout_s=60)
        deadline = time.monotonic() + 30
        while pids_mentioning(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pids_mentioning(temp_dir) == [], "processes of the 2-node cluster survived its stop"
        if rejoin:
            ray_cluster.connect()


def _killed_midway(cluster: TwoNodes, title: str, stage: Callable[[], Any]) -> Any:
    """Run ``stage`` while the worker node is killed once ``title`` runs there; its result; a fresh worker node."""
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["result"] = stage()
        except BaseException as exc:
            outcome["error"] = exc

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        cluster.wait_until_running(title)
        assert driver.is_alive(), "the stage ended before the kill"
        cluster.kill_worker_node()
        driver.join(timeout=300)
        assert not driver.is_alive(), "the stage did not finish after the node loss"
    finally:
        cluster.start_worker()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def test_ingest_survives_the_loss_of_a_node(two_nodes: TwoNodes, s3_storage: str) -> None:
    seeded = seed(storage.join(s3_storage, "raw"))
    cfg = ingest.IngestConfig(
        source_uri=seeded.uri, output_root=storage.join(s3_storage, "ingested"), min_shards=24, io_concurrency=2
    )
    result = _killed_midway(two_nodes, "ray::_fetch_and_write_shard", lambda: ingest.run(cfg))

    # Ray retried the killed shard tasks (max_retries): one row per object, no error row, manifest agrees
    rows = storage.read_parquet(result.shard_uris).drop_columns(["data"])
    uris = rows.column("uri").to_pylist()
    expected = {storage.join(seeded.uri, o.key) for o in storage.list_objects(seeded.uri)}
    assert len(uris) == len(set(uris)) and set(uris) == expected
    assert rows.column("error_type").null_count == rows.num_rows and result.fetch_errors == 0
    assert result.object_count == len(expected) == sum(s.rows for s in result.shards)
    assert ingest.read_manifest(result.manifest_uri).shard_uris == result.shard_uris


def test_nightly_inference_survives_the_loss_of_a_node(two_nodes: TwoNodes, s3_storage: str) -> None:
    day = "2026-11-29"
    model = register_untrained()
    arrivals = seed_incoming(storage.join(s3_storage, "incoming", f"dt={day}"), corrupt=4)
    inputs = {storage.join(arrivals.uri, o.key) for o in storage.list_objects(arrivals.uri)}
    cfg = batch_inference.InferenceConfig(
        input_uri=arrivals.uri, tables_root=s3_storage, dt=day, model=model, actors=3, cpus_per_actor=1.0,
        objects_per_task=16, batch_size=16,
    )  # fmt: skip
    result = _killed_midway(two_nodes, "PredictorUDF", lambda: batch_inference.run(cfg))

    # Ray Data restarted the lost actors and retried their blocks; the commit takes one file set per block
    pair = read_night_pair(s3_storage, model.name, day)
    uris = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
    assert sorted(uris) == sorted(inputs), "an input has no row, or more than one"
    assert pair.errors.num_rows == 4
    assert result.predictions + result.errors == len(inputs)
