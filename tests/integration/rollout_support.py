"""What the serve-rollout tests share: short rollout requests, client threads loading the router, and reads of
Serve's state and of a rollout process's output."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
from ray import serve
from ray.serve.schema import ApplicationStatus

from rayline.flows.serve_rollout import RolloutRequest
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.serving.http_api import ANSWER_HEADER
from rayline.seed import digit_objects
from rayline.storage import leases
from tests.integration.helpers import ClientThreads, register_untrained

# short windows; the gates are the production ones. 8 probe images (64 by default): the agreement
# check pins each to both versions, one request after another, before the first step's weight moves
FAST = {"soak_s": 3.0, "gates": {"min_requests": 10}, "probe_images": 8}


def fast(gates: dict[str, float] | None = None, **fields: object) -> RolloutRequest:
    """A rollout request with short soaks and few probes: ``fields`` and ``gates`` on top."""
    return RolloutRequest.model_validate({**FAST, "gates": {"min_requests": 10, **(gates or {})}, **fields})


def register_digits(seed: int, broken: bool = False) -> ModelVersion:
    return register_untrained("digits", seed=seed, broken=broken)


class Load(ClientThreads):
    """Client threads posting images through the router until stopped; every outcome kept.

    Each client waits ``PAUSE_S`` between its requests: three of them back to back kept both
    cores busy with requests, slowing the deploys and the flow under test (and the latency
    samples the gate judges) for no more evidence than tens of requests a second give.
    """

    PAUSE_S = 0.05

    def __init__(self, url: str, image: bytes) -> None:
        self.url, self.image = url, image
        self.statuses: Counter[int] = Counter()
        self.by_version: Counter[tuple[str, int]] = Counter()
        self.connection_errors: list[str] = []
        super().__init__(self._client_loop, 3, join_timeout_s=60)

    def _client_loop(self, _: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.wait(self.PAUSE_S):
                try:
                    answer = client.post("/predict", content=self.image)
                except httpx.HTTPError as exc:
                    self.connection_errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.statuses[answer.status_code] += 1
                self.by_version[(answer.headers.get(ANSWER_HEADER, "?"), answer.status_code)] += 1


def probe_image() -> bytes:
    return next(iter(digit_objects(32)))[1]


def replica_ids(app: str) -> set[str]:
    """Ids of ``app``'s replicas, whatever their state (Serve's own client: status() has no replica details).

    The raw dict: building ``ServeInstanceDetails`` pickles Serve's request-router class with
    process-global cloudpickle settings, which races a deploy running in another thread.
    """
    client = serve.context._get_global_client()
    assert client is not None
    found = client.get_serve_details()["applications"].get(app)
    return {r["replica_id"] for d in found["deployments"].values() for r in d["replicas"]} if found else set()


def wait_until(what: str, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)


def run_app(name: str, app: object) -> None:
    serve.run_many([serve.RunTarget(app, name=name, route_prefix=None)], wait_for_applications_running=False)


def app_status(name: str) -> ApplicationStatus | None:
    found = serve.status().applications.get(name)
    return found.status if found is not None else None


def lease_expired(uri: str) -> bool:
    current = leases.read(uri)
    return current is not None and not current.is_live()


def line_from(process: subprocess.Popen[str], timeout_s: float = 120.0) -> dict[str, object]:
    """The next line ``process`` prints, as JSON; fails (rather than hangs) when none comes."""
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"the paused rollout printed nothing within {timeout_s:.0f} s") from None
    assert line, f"the paused rollout exited ({process.wait(timeout=30)}) without a word"
    parsed: dict[str, object] = json.loads(line)
    return parsed
