"""Node loss drills on a real 2-node Ray cluster on this machine: the worker node's raylet is killed mid-stage.

One cluster for the module: a head (`ray start --head`) and a worker node
(`ray start --address=HEAD`) with its own CPUs and ports, both started and
stopped by PID. This process leaves the session's embedded cluster for it (a
process joins one cluster at a time) and rejoins an embedded one afterwards.
Each drill waits until the stage's work runs on the worker node, SIGKILLs that
node's raylet (its workers die with it), lets the stage finish with no retry by
the test, checks it wrote exactly one row per input, and starts a new worker
node for the next drill (in the background: the next drill waits for it to
join before its stage starts). The serving drill's new node joins before the
kill instead, with no replica on it until Serve replaces the lost ones there.
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
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import ray
from ray import serve
from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
from ray.serve.schema import ServeInstanceDetails

from ray_workloads import batch_inference, ingest, preprocess, train
from ray_workloads.serving import control as serve_control
from ray_workloads.serving.config import ServeConfig
from ray_workloads.training_loop import TrainLoopConfig
from rayline import ray_cluster, storage
from rayline.seed import SeedResult, png_bytes, seed
from rayline.specs import ImageSpec, ModelSpec
from rayline.tables.prediction_reads import read_night_pair
from tests.integration.helpers import ClientThreads, register_untrained
from tests.support import create_bucket, delete_bucket, free_port, pids_mentioning, stop_process, wait_for_port

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
        ports = _ports()
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


def _killed_midway(
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


NIGHT = "2026-11-29"


@pytest.fixture(scope="module")
def arrivals(s3_endpoint: str) -> Iterator[SeedResult]:
    """A night's arrivals in a bucket of the module's, seeded once: the input of both the ingest and the
    night drill (each writes only under its own test's bucket).

    900 digits and one broken object of each kind: the drills check one row per input, whatever the
    count, and wait for the work to run on the worker node before the kill; the count only has to keep
    the stage going past that (at the kill, each drill had most of its work still to do with all 1,797).
    """
    bucket = f"rayline-nl-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_endpoint, bucket)
    try:
        yield seed(f"s3://{bucket}/incoming/dt={NIGHT}", corrupt=4, digit_count=900)
    finally:
        delete_bucket(s3_endpoint, bucket)


def test_ingest_survives_the_loss_of_a_node(two_nodes: TwoNodes, arrivals: SeedResult, s3_storage: str) -> None:
    seeded = arrivals
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


def test_nightly_inference_survives_the_loss_of_a_node(
    two_nodes: TwoNodes, arrivals: SeedResult, s3_storage: str
) -> None:
    model = register_untrained()
    inputs = {storage.join(arrivals.uri, o.key) for o in storage.list_objects(arrivals.uri)}
    cfg = batch_inference.InferenceConfig(
        input_uri=arrivals.uri, tables_root=s3_storage, dt=NIGHT, model=model, actors=3, cpus_per_actor=1.0,
        objects_per_task=16, batch_size=16,
    )  # fmt: skip
    result = _killed_midway(two_nodes, "Predictor", lambda: batch_inference.run(cfg))

    # Ray Data restarted the lost actors and retried their blocks; the commit takes one file set per block
    pair = read_night_pair(s3_storage, model.name, NIGHT)
    uris = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
    assert sorted(uris) == sorted(inputs), "an input has no row, or more than one"
    assert pair.errors.num_rows == 4
    assert result.predictions + result.errors == len(inputs)


def _checkpoints(run_uri: str) -> list[str]:
    return [name for name in storage.list_folders(run_uri) if name.startswith("checkpoint_")]


def test_training_resumes_from_its_last_checkpoint_after_the_loss_of_a_node(
    two_nodes: TwoNodes, s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray Train's controller looks at its workers every 2 s by default (it sees the lost worker, and the
    # end of the fit, at that step); Ray Train passes this on to the controller it starts. A poll that
    # takes longer is only awaited at the next one (a worker is declared hung after 10 minutes).
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    seed(storage.join(s3_storage, "raw"), digits=False, synthetic=240)
    ingested = ingest.run(
        ingest.IngestConfig(source_uri=storage.join(s3_storage, "raw"), output_root=storage.join(s3_storage, "in"))
    )
    prepared = preprocess.run(
        preprocess.PreprocessConfig(
            ingest_manifest_uri=ingested.manifest_uri,
            output_root=storage.join(s3_storage, "pre"),
            image=ImageSpec(crop=16),
        )
    )
    epochs = 8
    cfg = train.TrainConfig(
        data_manifest_uri=prepared.manifest_uri,
        output_root=storage.join(s3_storage, "runs"),
        run_name="node-loss",
        loop=TrainLoopConfig(model=ModelSpec(width=4), epochs=epochs, batch_size=64),
        # one worker wanting 3 CPUs: the head (2 CPUs) has no room for it, only the worker node (4)
        num_workers=1,
        cpus_per_worker=3.0,
        use_gpu=False,
        max_failures=2,
    )
    run_uri = storage.join(cfg.output_root, cfg.run_name)
    seen: list[str] = []

    def checkpointed() -> bool:
        seen[:] = _checkpoints(run_uri)
        return len(seen) >= 1

    result = _killed_midway(
        two_nodes, "RayTrainWorker", lambda: train.run(cfg), ready=checkpointed, replace_at_once=True
    )

    # Ray Train restarted the worker group on the new node (FailureConfig) from the newest checkpoint
    history = result.history
    assert [h.epoch for h in history] == list(range(epochs)), "each epoch reported once"
    starts = sorted({h.attempt_start_epoch for h in history})
    assert len(starts) == 2 and starts[0] == 0, f"one restart expected, attempts started at {starts}"
    resumed = starts[1]
    assert resumed >= len(seen) >= 1, "resumed before the newest checkpoint that existed at the kill"
    # (an epoch may end just after the kill: the worker process outlives its raylet by a moment)
    after = [h for h in history if h.attempt_start_epoch == resumed]
    assert min(h.attempt_started_at for h in after) > two_nodes.killed_at, "the resumed attempt ran after it"
    assert all(np.isfinite(h.train_loss) for h in history) and 0.0 <= result.metrics["val_accuracy"] <= 1.0
    assert storage.exists(result.weights_uri)


def _replica_nodes(cfg: ServeConfig) -> dict[str, list[str]]:
    """Node of each RUNNING replica, by application of this serving instance."""
    client = serve.context._get_global_client()
    assert client is not None
    details = ServeInstanceDetails(**client.get_serve_details())
    return {
        name: sorted(r.node_id or "" for d in app.deployments.values() for r in d.replicas if r.state == "RUNNING")
        for name, app in details.applications.items()
        if name == cfg.name or name.startswith(f"{cfg.name}-")
    }


def _node_id(node_manager_port: int) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerPort"] == node_manager_port]  # type: ignore[no-untyped-call]
    return str(node)


class _Predictions(ClientThreads):
    """Clients posting one image after another to ``/predict``; every answer recorded."""

    def __init__(self, url: str, workers: int) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.answers: list[tuple[float, float, str]] = []  # (sent at, answered at, "" or why it failed)
        super().__init__(self._run, workers)

    def _run(self, worker: int) -> None:
        image = png_bytes(np.random.default_rng(worker).integers(0, 256, (32, 32, 3), dtype=np.uint8))
        with httpx.Client(base_url=self.url, timeout=60, trust_env=False) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    response = client.post("/predict", content=image, headers={"content-type": "image/png"})
                    ok = response.status_code == 200 and "class_index" in response.json()
                    why = "" if ok else f"{response.status_code} {response.text[:300]}"
                except httpx.HTTPError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    self.answers.append((sent, time.monotonic(), why))

    def failures(self) -> list[str]:
        with self.lock:
            return [why for _, _, why in self.answers if why]

    def failed_apart_from_those_in_flight_at(self, killing: float, killed: float) -> list[str]:
        """Failures other than a 500 for a request in flight while the node died (``killing`` to ``killed``)."""
        with self.lock:
            return [
                why
                for sent, answered, why in self.answers
                if why and not (sent < killed and answered > killing and why.startswith("500 "))
            ]

    def answered_since(self, since: float) -> int:
        with self.lock:
            return sum(1 for sent, _, why in self.answers if sent > since and not why)


def test_serving_answers_every_request_while_a_node_is_lost(two_nodes: TwoNodes, s3_storage: str) -> None:
    """Two router and two model replicas, one of each per node; the worker node is killed under load.

    A model call lost with its replica is retried by the router (serving.ingress ``_call_model``). The
    head's proxy sends requests to the router replica on its own node (Serve's local-node
    preference) while that one has room, so the worker node's router replica holds no request
    when it dies. (With that preference off, Serve's proxy answers 500 to each request in flight
    inside the dying router replica, 1–2 of ~3,600 here: it does not retry a request a replica
    has accepted; README "Node loss".)
    """
    model = register_untrained("digits-nl")
    cfg = ServeConfig(
        name="rayline-nl", port=free_port(), replicas=2, router_replicas=2, max_replicas_per_node=1, access_log=False,
        # Serve notices a lost replica at its next health check (10 s for models, 5 s for routers by default)
        # and only then starts its replacement; a deleted replica drains in steps of 2 s (the shutdown)
        model_health_check_period_s=1.0, router_health_check_period_s=1.0, graceful_shutdown_wait_loop_s=0.1,
    )  # fmt: skip
    apps = [cfg.name, cfg.version_app(model.name, model.version)]
    two_nodes.wait_for_worker()  # the replacement launched after the previous drill
    try:
        url = serve_control.start(cfg)
        serve_control.deploy_version(model, cfg)
        serve_control.set_weights({model.version: 1}, cfg, model=model.name)
        doomed = _node_id(two_nodes.node_manager_port)
        placed = _replica_nodes(cfg)
        for app in apps:  # one router replica and one model replica on each node
            assert len(set(placed[app])) == 2 and doomed in placed[app], placed
        # where Serve can place the replacements (at most one per node), joining while the load starts
        # (a node's start takes long on a loaded machine: it was most of the wait after the kill)
        two_nodes.launch_spare()

        with _Predictions(url, workers=4) as load:
            deadline = time.monotonic() + 60
            while load.answered_since(0) < 20:
                assert time.monotonic() < deadline and not load.failures(), load.failures()[:3]
                time.sleep(0.1)
            two_nodes.wait_for_spare()
            assert _replica_nodes(cfg) == placed, "Serve moved replicas before the kill"  # none on the spare
            killing = time.monotonic()
            two_nodes.kill_worker_node()  # its raylet, then the rest of that node; the spare is the worker now
            killed = time.monotonic()
            fresh = _node_id(two_nodes.node_manager_port)
            deadline = killed + 120
            while True:
                placed = _replica_nodes(cfg)
                if time.monotonic() - killed >= 5 and all(fresh in placed.get(app, []) for app in apps):
                    break
                assert time.monotonic() < deadline, f"replicas not replaced on the new node: {placed}"
                time.sleep(0.5)
            replaced_s = time.monotonic() - killed
            time.sleep(1.0)  # traffic on the replacements too
        print(f"replicas replaced {replaced_s:.1f} s after the kill; {len(load.answers)} requests")
        # Serve's proxy answers 500 for a request in flight inside a router replica that dies, and does not
        # retry it (README "Node loss"); its local-node preference keeps that replica idle, but only while
        # the head's router answers the proxy's queue probe in time, which a loaded machine does not always
        # do. So: no failure at all apart from those, and those at most one per client.
        assert load.failed_apart_from_those_in_flight_at(killing, killed) == [], load.failures()[:5]
        assert len(load.failures()) <= 4, f"{len(load.failures())} failed: {load.failures()[:5]}"
        assert load.answered_since(killed) > 20
        for app in apps:
            assert len(set(placed[app])) == 2 and doomed not in placed[app], placed
    finally:
        serve_control.shutdown(cfg)
        serve.shutdown()  # type: ignore[no-untyped-call]  # (a no-op when that stopped Serve already)
