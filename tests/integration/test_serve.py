"""Online serving through the real HTTP proxy: API, bad inputs, weighted split, live weight moves, failures.

One serving instance for the module (Serve on a free loopback port inside the session's Ray
cluster, two router replicas so that stats are checked across routers), shut down at the end.
"""

from __future__ import annotations

import io
import os
import random
import signal
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import ray
from PIL import Image

from ray_workloads.serving import control as serve_control
from ray_workloads.serving.control import ServeConfig
from ray_workloads.serving.http_api import ANSWER_HEADER, KEY_HEADER, VERSION_HEADER, HttpError, multipart_image
from ray_workloads.serving.rollout import GateConfig, judge
from ray_workloads.serving.routing import choose_version
from rayline.errors import ConfigError
from rayline.ray_cluster import NAMESPACE
from rayline.registry import ModelVersion
from tests.integration.helpers import ClientThreads, register_untrained
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

MODEL = "digits-serve"
MAX_BODY = 1024 * 1024


@dataclass
class Serving:
    cfg: ServeConfig
    url: str
    versions: dict[int, ModelVersion]


def _register(seed: int, broken: bool = False) -> ModelVersion:
    return register_untrained(MODEL, seed=seed, broken=broken, class_prefix="digit-")


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYLINE_STORAGE", str(tmp_path_factory.mktemp("serve-storage")))
        versions = {v.version: v for v in (_register(0), _register(1), _register(2, broken=True))}
    cfg = ServeConfig(
        name="rayline-test", port=free_port(), max_body_bytes=MAX_BODY, router_replicas=2, access_log=False
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


def _png(seed: int, size: int = 32) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of ``width`` x ``height`` zeros: tiny on the wire, huge once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _client(serving: Serving) -> httpx.Client:
    return httpx.Client(base_url=serving.url, timeout=60, trust_env=False)


def _predict(client: httpx.Client, body: bytes, **headers: str) -> httpx.Response:
    return client.post("/predict", content=body, headers={"content-type": "image/png", **headers})


def _load(serving: Serving, n: int, workers: int, key: Callable[[int], dict[str, str]] | None = None) -> list[int]:
    """``n`` predictions from ``workers`` concurrent clients; the answering version of each."""
    image = _png(7)
    local = threading.local()
    clients: list[httpx.Client] = []

    def one(i: int) -> int:
        if not hasattr(local, "client"):
            local.client = _client(serving)
            clients.append(local.client)
        response = _predict(local.client, image, **(key(i) if key else {}))
        assert response.status_code == 200, response.text
        return int(response.headers[ANSWER_HEADER])

    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, range(n)))
    finally:
        for client in clients:
            client.close()


def test_routing_by_key_is_sticky_and_moves_keys_one_way() -> None:
    keys = [f"user-{i}" for i in range(2000)]
    rng = random.Random(0)
    on_new = [{k for k in keys if choose_version({1: 100 - w, 2: w}, k, rng) == 2} for w in (0, 10, 50, 100)]
    assert [len(s) for s in (on_new[0], on_new[-1])] == [0, len(keys)]
    assert on_new[0] <= on_new[1] <= on_new[2] <= on_new[3], "raising the weight moved a key back"
    assert abs(len(on_new[1]) / len(keys) - 0.10) < 0.03
    assert choose_version({1: 0.0}, None, rng) is None


def test_multipart_picks_the_file_part() -> None:
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="note"\r\n\r\nhello\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="upload"; filename="a.png"\r\n'
        b"Content-Type: image/png\r\n\r\n\x89PNG\r\n\x00\xff--\r\n--XyZ--\r\n"
    )
    assert multipart_image(body, 'multipart/form-data; boundary="XyZ"') == b"\x89PNG\r\n\x00\xff--"
    with pytest.raises(HttpError, match="no image part"):
        multipart_image(body.replace(b'; filename="a.png"', b""), "multipart/form-data; boundary=XyZ")


def test_predict_api_raw_multipart_pinned_and_sticky(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 1.0}, cfg)  # versions left out get 0
    assert serve_control.get_weights(cfg) == {1: 1.0, 2: 0.0, 3: 0.0}
    assert serve_control.live_versions(cfg) == [1, 2, 3]
    image = _png(1)
    with _client(serving) as client:
        raw = _predict(client, image)
        assert raw.status_code == 200, raw.text
        body = raw.json()
        assert raw.headers[ANSWER_HEADER] == "1" and body["version"] == 1 and body["model"] == MODEL
        assert body["class_name"] == f"digit-{body['class_index']}" and 0 < body["confidence"] <= 1
        assert [t["index"] for t in body["top_k"]][0] == body["class_index"] and len(body["top_k"]) == 3
        assert body["top_k"][0]["prob"] >= body["top_k"][1]["prob"] >= body["top_k"][2]["prob"]
        assert body["latency_ms"] > 0

        multipart = client.post("/predict", files={"file": ("x.png", image, "image/png")})
        assert multipart.status_code == 200, multipart.text
        assert multipart.json()["top_k"] == body["top_k"]

        pinned = _predict(client, image, **{VERSION_HEADER: "2"})  # weight 0, but live: the gate compares so
        assert pinned.status_code == 200 and pinned.json()["version"] == 2
        missing = _predict(client, image, **{VERSION_HEADER: "99"})
        assert missing.status_code == 404 and missing.json()["error"] == "VersionNotLive"

        latencies = []
        for _ in range(100):
            begin = time.perf_counter()
            assert _predict(client, image).status_code == 200
            latencies.append((time.perf_counter() - begin) * 1000)
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
        print(f"sequential client latency p50/p95/p99 {p50:.1f}/{p95:.1f}/{p99:.1f} ms")

        health = client.get("/healthz")
        assert health.status_code == 200 and health.json()["weights"] == {"1": 1.0, "2": 0.0, "3": 0.0}

    serve_control.set_weights({1: 1.0, 2: 1.0}, cfg)
    keys = [f"client-{i}" for i in range(40)]
    answers = _load(serving, 5 * len(keys), 8, key=lambda i: {KEY_HEADER: keys[i % len(keys)]})
    per_key = {k: {answers[i] for i in range(len(answers)) if i % len(keys) == n} for n, k in enumerate(keys)}
    assert all(len(seen) == 1 for seen in per_key.values()), "a key saw two versions"
    assert {v for seen in per_key.values() for v in seen} == {1, 2}

    # idempotent: nothing is redeployed
    pids = serve_control.replica_pids(cfg)
    assert serve_control.start(cfg) == serving.url
    serve_control.deploy_version(serving.versions[1], cfg)
    assert serve_control.replica_pids(cfg) == pids


def test_split_accuracy_at_10_percent(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 90, 2: 10}, cfg)
    serve_control.reset_stats(cfg)
    n = 1500
    started = time.monotonic()
    answers = Counter(_load(serving, n, 8))
    elapsed = time.monotonic() - started
    share = answers[2] / n
    assert abs(share - 0.10) <= 0.03, f"challenger share {share:.3f} at weight 10%"

    # stats aggregated over both router replicas count every request once
    observed = serve_control.stats(cfg)
    assert {v: s.requests for v, s in observed.items()} == dict(answers)
    assert all(s.errors == 0 and s.p50_ms is not None for s in observed.values())
    with _client(serving) as client:
        over_http = client.get("/stats").json()["versions"]
    assert {int(v): s["requests"] for v, s in over_http.items()} == dict(answers)
    s1 = observed[1]
    print(
        f"{n} requests in {elapsed:.1f} s ({n / elapsed:.0f}/s, 8 clients); challenger share {share:.3f}; "
        f"v1 p50/p95/p99 {s1.p50_ms:.1f}/{s1.p95_ms:.1f}/{s1.p99_ms:.1f} ms"
    )


def test_pinned_requests_and_4xx_do_not_count_toward_the_gate(serving: Serving) -> None:
    """Junk pinned to a candidate at 0 % (or refused as bad input) must not meet the rollout's
    ``min_requests`` nor move its error rate; routed answers, errors included, still count."""
    cfg = serving.cfg
    serve_control.set_weights({1: 1}, cfg)  # v2, v3: candidates at 0 %
    window = serve_control.reset_stats(cfg)
    good, junk = _png(5), b"junk, not an image: the decoder refuses it"
    with _client(serving) as client:
        pinned = [_predict(client, body, **{VERSION_HEADER: "2"}) for body in [good] * 5 + [junk] * 5]
        pinned += [_predict(client, good, **{VERSION_HEADER: "3"}) for _ in range(3)]  # the broken one: 500
        routed = [_predict(client, body) for body in [good] * 4 + [junk] * 3]
        serve_control.set_weights({3: 1}, cfg)
        routed += [_predict(client, good) for _ in range(2)]
    serve_control.set_weights({1: 1}, cfg)
    assert [a.status_code for a in pinned] == [200] * 5 + [415] * 5 + [500] * 3
    assert [a.status_code for a in routed] == [200] * 4 + [415] * 3 + [500] * 2

    everything = serve_control.stats(cfg)  # what /stats shows: every answer
    assert {v: (s.requests, s.errors, s.rejected) for v, s in everything.items()} == {
        1: (7, 0, 3),
        2: (10, 0, 5),
        3: (5, 5, 0),
    }
    for since in (None, window):  # the rollout reads its soak window with since=
        gate = serve_control.stats(cfg, since=since, gated=True)
        assert {v: (s.requests, s.errors) for v, s in gate.items()} == {1: (4, 0), 2: (0, 0), 3: (2, 2)}, since
        assert gate[2].p95_ms is None and gate[1].p95_ms is not None
    passed, reason = judge(gate[2], None, None, GateConfig(min_requests=5))
    assert not passed and "only 0 candidate requests" in reason


def test_bad_inputs_get_clear_4xx_and_replicas_survive(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 1, 2: 1}, cfg)
    pids = serve_control.replica_pids(cfg)
    good = _png(3)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the router counts what arrives
        for _ in range(20):
            yield b"\x00" * 64 * 1024

    cases: list[tuple[str, httpx.Response, int, str]] = []
    with _client(serving) as client:
        cases += [
            ("oversize", _predict(client, b"\x00" * (MAX_BODY + 1)), 413, "PayloadTooLarge"),
            ("oversize x8", _predict(client, b"\x00" * (8 * MAX_BODY)), 413, "PayloadTooLarge"),
            ("oversize chunked", client.post("/predict", content=chunked()), 413, "PayloadTooLarge"),
            ("empty", _predict(client, b""), 400, "EmptyBody"),
            ("not an image", _predict(client, b"hello, this is text and not a picture"), 415, "UnsupportedFormatError"),
            ("truncated", _predict(client, good[: len(good) // 2]), 422, "CorruptImageError"),
            ("bomb", _predict(client, _png_bomb(20_000, 20_000)), 422, "ImageTooLargeError"),
            (
                "multipart text",
                client.post("/predict", files={"file": ("a.txt", b"text", "text/plain")}),
                415,
                "UnsupportedFormatError",
            ),
            (
                "multipart no boundary",
                _predict(client, good, **{"content-type": "multipart/form-data"}),
                400,
                "BadMultipart",
            ),
            *[
                (f"stats since {since}", client.get("/stats", params={"since": since}), 400, "BadRequest")
                for since in ("nan", "inf", "-inf")  # float() takes them; nan answered 500
            ],
            ("wrong method", client.get("/predict"), 405, "MethodNotAllowed"),
            ("unknown path", client.get("/nope"), 404, "NotFound"),
        ]
        for name, response, status, error in cases:
            assert response.status_code == status, f"{name}: {response.status_code} {response.text}"
            body = response.json()
            assert body["error"] == error and len(body["detail"]) > 10, f"{name}: {body}"
        detail = {name: response.json()["detail"] for name, response, _, _ in cases}
        assert "limit" in detail["oversize"] and "pixels" in detail["bomb"] and "limit" in detail["bomb"]
        assert _predict(client, good).status_code == 200
    assert serve_control.replica_pids(cfg) == pids, "a bad input restarted a replica"


def test_broken_version_answers_5xx_counted_in_stats(serving: Serving) -> None:
    cfg = serving.cfg
    app = cfg.version_app(MODEL, 3)
    pids = serve_control.replica_pids(cfg)[app]
    serve_control.reset_stats(cfg)
    with _client(serving) as client:
        answers = [_predict(client, _png(i), **{VERSION_HEADER: "3"}) for i in range(5)]
    assert all(a.status_code == 500 and a.json()["error"] == "ModelOutputError" for a in answers), answers[0].text
    observed = serve_control.stats(cfg)[3]
    assert (observed.requests, observed.errors, observed.error_rate) == (5, 5, 1.0)
    assert serve_control.replica_pids(cfg)[app] == pids

    for bad in ({99: 1.0}, {1: -1.0}, {1: 0.0, 2: 0.0}, {1: float("nan")}):
        with pytest.raises(ConfigError):
            serve_control.set_weights(bad, cfg)
    serve_control.set_weights({1: 1, 3: 1}, cfg)
    with pytest.raises(ConfigError, match="set it to 0 first"):
        serve_control.remove_version(3, cfg)
    serve_control.set_weights({1: 1}, cfg)
    serve_control.remove_version(3, cfg)
    assert serve_control.live_versions(cfg) == [1, 2] and app not in serve_control.replica_pids(cfg)
    with _client(serving) as client:
        assert _predict(client, _png(0), **{VERSION_HEADER: "3"}).status_code == 404


class _Load(ClientThreads):
    """Clients sending predictions until stopped; each failure retried once (like a real client)."""

    def __init__(self, serving: Serving, workers: int, retry: bool) -> None:
        self.serving, self.retry = serving, retry
        self.lock = threading.Lock()
        self.results: list[tuple[float, float, int | None]] = []  # started, finished, version (None: failed)
        self.first_failures: list[str] = []
        super().__init__(self._run, workers)

    def _attempt(self, client: httpx.Client, image: bytes) -> tuple[int | None, str]:
        try:
            response = _predict(client, image)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return None, f"{response.status_code} {response.text[:200]}"
        return int(response.headers[ANSWER_HEADER]), ""

    def _run(self, worker: int) -> None:
        image = _png(100 + worker)
        with _client(self.serving) as client:
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


def test_weights_move_0_10_50_100_under_load_without_errors(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 1, 2: 0}, cfg)
    asked: dict[int, float] = {}
    switched: dict[int, float] = {}
    with _Load(serving, workers=6, retry=False) as load:
        time.sleep(1.0)
        for weight in (10, 50, 100):
            asked[weight] = time.monotonic()
            serve_control.set_weights({1: 100 - weight, 2: weight}, cfg)
            switched[weight] = time.monotonic()
            time.sleep(1.5)
    assert load.first_failures == [] and load.failed() == 0
    assert len(load.results) > 100
    before = [v for started, _, v in load.results if started < asked[10]]
    after = [v for started, _, v in load.results if started > switched[100]]
    assert set(before) == {1} and set(after) == {2}, "set_weights returned before every router switched"
    middle = Counter(v for started, _, v in load.results if switched[50] < started < asked[100])
    assert 0.3 < middle[2] / sum(middle.values()) < 0.7


def _kill_and_wait_for_replacement(cfg: ServeConfig, app: str, timeout_s: float = 90) -> float:
    pids = serve_control.replica_pids(cfg)[app]
    os.kill(pids[0], signal.SIGKILL)  # a replica process of our own session's cluster
    killed = time.monotonic()
    while time.monotonic() - killed < timeout_s:
        current = serve_control.replica_pids(cfg).get(app, [])
        if len(current) == len(pids) and pids[0] not in current:
            return time.monotonic() - killed
        time.sleep(0.2)
    raise AssertionError(f"{app}: replica {pids[0]} was not replaced within {timeout_s} s")


def test_killed_replicas_are_replaced_while_requests_continue(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({2: 1}, cfg)
    with _Load(serving, workers=4, retry=True) as load:
        time.sleep(1.0)
        model_s = _kill_and_wait_for_replacement(cfg, cfg.version_app(MODEL, 2))
        time.sleep(1.0)
        router_s = _kill_and_wait_for_replacement(cfg, cfg.name)
        time.sleep(1.0)
    print(
        f"model replica replaced in {model_s:.1f} s, router replica in {router_s:.1f} s; "
        f"{len(load.results)} requests, first attempts failed: {len(load.first_failures)} {load.first_failures[:3]}"
    )
    assert load.failed() == 0, "a request failed even after the client's retry"
    assert {v for *_, v in load.results} == {2}
    with _client(serving) as client:
        assert client.get("/healthz").status_code == 200


def test_control_actor_killed_routing_goes_on_and_weights_survive(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 3, 2: 1}, cfg)
    control = ray.get_actor(cfg.control_actor_name, namespace=NAMESPACE)
    pid = ray.get(control.__ray_call__.remote(lambda _self: os.getpid()))
    with _Load(serving, workers=4, retry=False) as load:
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        assert serve_control.get_weights(cfg) == {1: 3.0, 2: 1.0}  # answered by the restarted actor
        serve_control.set_weights({1: 1, 2: 1}, cfg)
        time.sleep(0.5)
    assert ray.get(control.__ray_call__.remote(lambda _self: os.getpid())) != pid
    assert load.first_failures == [] and {v for *_, v in load.results} == {1, 2}
