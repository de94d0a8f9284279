"""The serving harness of test_serve.py: one Serve instance a module, its clients, loads and replica handles."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from rayline.models.registry import ModelVersion
from rayline.ray_workloads.serving import control as serve_control
from rayline.ray_workloads.serving.control import ServeConfig
from rayline.ray_workloads.serving.http_api import ANSWER_HEADER
from rayline.ray_workloads.serving.ingress import ROUTER_DEPLOYMENT
from tests.integration.helpers import ClientThreads, register_untrained
from tests.support import free_port

MODEL = "digits-serve"
MAX_BODY = 1024 * 1024


@dataclass
class Serving:
    cfg: ServeConfig
    url: str
    versions: dict[int, ModelVersion]


def register_version(seed: int, broken: bool = False) -> ModelVersion:
    return register_untrained(MODEL, seed=seed, broken=broken, class_prefix="digit-")


@contextlib.contextmanager
def serving_instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """Serve on a free loopback port with two routers and three versions (the third broken); shut down after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYLINE_STORAGE", str(tmp_path_factory.mktemp("serve-storage")))
        versions = {v.version: v for v in (register_version(0), register_version(1), register_version(2, broken=True))}
    cfg = ServeConfig(
        name="rayline-test",
        port=free_port(),
        max_body_bytes=MAX_BODY,
        router_replicas=2,
        access_log=False,
        # Serve notices a killed replica at its next health check (10 s for models, 5 s for routers by
        # default), and a stopping replica drains in steps of 2 s: the failure tests wait on both
        model_health_check_period_s=1.0,
        router_health_check_period_s=1.0,
        graceful_shutdown_wait_loop_s=0.1,
    )
    try:
        started = time.monotonic()
        url = serve_control.start(cfg)
        up = time.monotonic()
        serve_control.deploy_versions(list(versions.values()), cfg)
        print(f"serve + router up in {up - started:.1f} s, 3 versions deployed in {time.monotonic() - up:.1f} s")
        yield Serving(cfg, url, versions)
    finally:
        serve_control.shutdown(cfg)


def png(seed: int, size: int = 32) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of ``width`` x ``height`` zeros: tiny on the wire, huge once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def client_of(serving: Serving) -> httpx.Client:
    return httpx.Client(base_url=serving.url, timeout=60, trust_env=False)


def predict(client: httpx.Client, body: bytes, **headers: str) -> httpx.Response:
    return client.post("/predict", content=body, headers={"content-type": "image/png", **headers})


def answers_under_load(
    serving: Serving, n: int, workers: int, key: Callable[[int], dict[str, str]] | None = None
) -> list[int]:
    """``n`` predictions from ``workers`` concurrent clients; the answering version of each."""
    image = png(7)
    local = threading.local()
    clients: list[httpx.Client] = []

    def one(i: int) -> int:
        if not hasattr(local, "client"):
            local.client = client_of(serving)
            clients.append(local.client)
        response = predict(local.client, image, **(key(i) if key else {}))
        assert response.status_code == 200, response.text
        return int(response.headers[ANSWER_HEADER])

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, range(n)))
    finally:
        for client in clients:
            client.close()


class Load(ClientThreads):
    """Clients sending predictions until stopped; each failure retried once (like a real client)."""

    def __init__(self, serving: Serving, workers: int, retry: bool) -> None:
        self.serving, self.retry = serving, retry
        self.lock = threading.Lock()
        self.results: list[tuple[float, float, int | None]] = []  # started, finished, version (None: failed)
        self.first_failures: list[str] = []
        super().__init__(self._run, workers)

    def _attempt(self, client: httpx.Client, image: bytes) -> tuple[int | None, str]:
        try:
            response = predict(client, image)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return None, f"{response.status_code} {response.text[:200]}"
        return int(response.headers[ANSWER_HEADER]), ""

    def _run(self, worker: int) -> None:
        image = png(100 + worker)
        with client_of(self.serving) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                version, why = self._attempt(client, image)
                if version is None:
                    with self.lock:
                        self.first_failures.append(why)
                    if self.retry:
                        time.sleep(0.2)
                        version, why = self._attempt(client, image)
                with self.lock:
                    self.results.append((started, time.monotonic(), version))

    def failed(self) -> int:
        return sum(1 for *_, version in self.results if version is None)


def kill_and_wait_for_replacement(cfg: ServeConfig, app: str, timeout_s: float = 90) -> float:
    pids = serve_control.replica_pids(cfg)[app]
    os.kill(pids[0], signal.SIGKILL)  # a replica process of our own session's cluster
    killed = time.monotonic()
    while time.monotonic() - killed < timeout_s:
        current = serve_control.replica_pids(cfg).get(app, [])
        if len(current) == len(pids) and pids[0] not in current:
            return time.monotonic() - killed
        time.sleep(0.2)
    raise AssertionError(f"{app}: replica {pids[0]} was not replaced within {timeout_s} s")


def router_replicas(cfg: ServeConfig) -> dict[str, int]:
    """Replica id → PID of the router's RUNNING replicas (Serve's own client: the raw dict, as in
    test_serve_rollout's ``_replica_ids``)."""
    client = serve.context._get_global_client()
    assert client is not None
    deployment = client.get_serve_details()["applications"][cfg.name]["deployments"][ROUTER_DEPLOYMENT]
    return {r["replica_id"]: r["pid"] for r in deployment["replicas"] if r["state"] == "RUNNING"}


def wait_for(what: str, done: Callable[[], bool], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.2)
