"""Online serving through the real HTTP proxy: API, bad inputs, weighted split, live weight moves, failures.

One serving instance for the module (Serve on a free loopback port inside the session's Ray
cluster, two router replicas so that stats are checked across routers), shut down at the end.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import ray

from rayline.errors import ClusterError, ConfigError, HttpError
from rayline.ray_cluster import NAMESPACE
from rayline.ray_workloads.serving import control as serve_control
from rayline.ray_workloads.serving.http_api import ANSWER_HEADER, KEY_HEADER, VERSION_HEADER, multipart_image
from rayline.ray_workloads.serving.rollout import GateConfig, judge
from rayline.ray_workloads.serving.routing import choose_version
from tests.integration.helpers import ClientThreads
from tests.integration.serve_harness import (
    MAX_BODY,
    MODEL,
    Load,
    Serving,
    answers_under_load,
    client_of,
    kill_and_wait_for_replacement,
    png,
    png_bomb,
    predict,
    router_replicas,
    serving_instance,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    with serving_instance(tmp_path_factory) as instance:
        yield instance


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
    image = png(1)
    with client_of(serving) as client:
        raw = predict(client, image)
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

        pinned = predict(client, image, **{VERSION_HEADER: "2"})  # weight 0, but live: the gate compares so
        assert pinned.status_code == 200 and pinned.json()["version"] == 2
        missing = predict(client, image, **{VERSION_HEADER: "99"})
        assert missing.status_code == 404 and missing.json()["error"] == "VersionNotLive"

        latencies = []  # a glimpse for the log (bench/serve.py measures latency): each answer must be a 200
        for _ in range(30):
            begin = time.perf_counter()
            assert predict(client, image).status_code == 200
            latencies.append((time.perf_counter() - begin) * 1000)
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
        print(f"sequential client latency p50/p95/p99 {p50:.1f}/{p95:.1f}/{p99:.1f} ms")

        health = client.get("/healthz")
        assert health.status_code == 200 and health.json()["weights"] == {"1": 1.0, "2": 0.0, "3": 0.0}

    serve_control.set_weights({1: 1.0, 2: 1.0}, cfg)
    keys = [f"client-{i}" for i in range(40)]
    answers = answers_under_load(serving, 5 * len(keys), 8, key=lambda i: {KEY_HEADER: keys[i % len(keys)]})
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
    answers = Counter(answers_under_load(serving, n, 8))
    elapsed = time.monotonic() - started
    share = answers[2] / n
    assert abs(share - 0.10) <= 0.03, f"challenger share {share:.3f} at weight 10%"

    # stats aggregated over both router replicas count every request once
    observed = serve_control.stats(cfg)
    assert {v: s.requests for v, s in observed.items()} == dict(answers)
    assert all(s.errors == 0 and s.p50_ms is not None for s in observed.values())
    with client_of(serving) as client:
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
    good, junk = png(5), b"junk, not an image: the decoder refuses it"
    with client_of(serving) as client:
        pinned = [predict(client, body, **{VERSION_HEADER: "2"}) for body in [good] * 5 + [junk] * 5]
        pinned += [predict(client, good, **{VERSION_HEADER: "3"}) for _ in range(3)]  # the broken one: 500
        routed = [predict(client, body) for body in [good] * 4 + [junk] * 3]
        serve_control.set_weights({3: 1}, cfg)
        routed += [predict(client, good) for _ in range(2)]
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
    good = png(3)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the router counts what arrives
        for _ in range(20):
            yield b"\x00" * 64 * 1024

    cases: list[tuple[str, httpx.Response, int, str]] = []
    with client_of(serving) as client:
        cases += [
            ("oversize", predict(client, b"\x00" * (MAX_BODY + 1)), 413, "PayloadTooLarge"),
            ("oversize x8", predict(client, b"\x00" * (8 * MAX_BODY)), 413, "PayloadTooLarge"),
            ("oversize chunked", client.post("/predict", content=chunked()), 413, "PayloadTooLarge"),
            ("empty", predict(client, b""), 400, "EmptyBody"),
            ("not an image", predict(client, b"hello, this is text and not a picture"), 415, "UnsupportedFormatError"),
            ("truncated", predict(client, good[: len(good) // 2]), 422, "CorruptImageError"),
            ("bomb", predict(client, png_bomb(20_000, 20_000)), 422, "ImageTooLargeError"),
            (
                "multipart text",
                client.post("/predict", files={"file": ("a.txt", b"text", "text/plain")}),
                415,
                "UnsupportedFormatError",
            ),
            (
                "multipart no boundary",
                predict(client, good, **{"content-type": "multipart/form-data"}),
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
        assert predict(client, good).status_code == 200
    assert serve_control.replica_pids(cfg) == pids, "a bad input restarted a replica"


def test_broken_version_answers_5xx_counted_in_stats(serving: Serving) -> None:
    cfg = serving.cfg
    app = cfg.version_app(MODEL, 3)
    pids = serve_control.replica_pids(cfg)[app]
    serve_control.reset_stats(cfg)
    with client_of(serving) as client:
        answers = [predict(client, png(i), **{VERSION_HEADER: "3"}) for i in range(5)]
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
    with client_of(serving) as client:
        assert predict(client, png(0), **{VERSION_HEADER: "3"}).status_code == 404


def test_weights_move_0_10_50_100_under_load_without_errors(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 1, 2: 0}, cfg)
    asked: dict[int, float] = {}
    switched: dict[int, float] = {}
    with Load(serving, workers=6, retry=False) as load:
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


def test_killed_replicas_are_replaced_while_requests_continue(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({2: 1}, cfg)
    with Load(serving, workers=4, retry=True) as load:
        time.sleep(1.0)
        model_s = kill_and_wait_for_replacement(cfg, cfg.version_app(MODEL, 2))
        time.sleep(1.0)
        router_s = kill_and_wait_for_replacement(cfg, cfg.name)
        time.sleep(1.0)
    print(
        f"model replica replaced in {model_s:.1f} s, router replica in {router_s:.1f} s; "
        f"{len(load.results)} requests, first attempts failed: {len(load.first_failures)} {load.first_failures[:3]}"
    )
    assert load.failed() == 0, "a request failed even after the client's retry"
    assert {v for *_, v in load.results} == {2}
    with client_of(serving) as client:
        assert client.get("/healthz").status_code == 200


def test_control_actor_killed_routing_goes_on_and_weights_survive(serving: Serving) -> None:
    cfg = serving.cfg
    serve_control.set_weights({1: 3, 2: 1}, cfg)
    control = ray.get_actor(cfg.control_actor_name, namespace=NAMESPACE)
    pid = ray.get(control.__ray_call__.remote(lambda _self: os.getpid()))
    with Load(serving, workers=4, retry=False) as load:
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        assert serve_control.get_weights(cfg) == {1: 3.0, 2: 1.0}  # answered by the restarted actor
        serve_control.set_weights({1: 1, 2: 1}, cfg)
        time.sleep(0.5)
    assert ray.get(control.__ray_call__.remote(lambda _self: os.getpid())) != pid
    assert load.first_failures == [] and {v for *_, v in load.results} == {1, 2}


def test_a_paused_router_holds_set_weights_and_a_gone_one_does_not(serving: Serving) -> None:
    """The routers a table change waits for are the router replicas Serve runs. One frozen (SIGSTOP)
    for longer than 5 s (a silence that counting routers by their syncs would take for gone) still routes
    by the old table as soon as it resumes: set_weights waits for it and fails naming it. Killed, Serve
    drops it from its replicas, and set_weights no longer waits for it."""
    cfg = serving.cfg
    serve_control.set_weights({1: 1, 2: 0}, cfg)
    replicas = router_replicas(cfg)
    assert len(replicas) == 2, replicas
    paused, pid = sorted(replicas.items())[0]
    os.kill(pid, signal.SIGSTOP)  # a router replica of our own session's cluster
    killed = False
    try:
        time.sleep(6.0)  # the scenario: silent for longer than the old 5 s cut-off
        began = time.monotonic()
        with pytest.raises(ClusterError, match="did not pick up routing generation") as caught:
            serve_control.set_weights({1: 1, 2: 1}, cfg, wait_s=2.0)
        assert time.monotonic() - began >= 2.0
        assert paused in str(caught.value) and f"pid {pid}" in str(caught.value), caught.value
        os.kill(pid, signal.SIGKILL)
        killed = True
    finally:
        if not killed:
            os.kill(pid, signal.SIGCONT)
    serve_control.set_weights({1: 1, 2: 0}, cfg, wait_s=30.0)  # returns once Serve no longer runs it
    # the module's two routers again, for the tests that follow
    wait_for("a replacement router", lambda: len(r := router_replicas(cfg)) == 2 and paused not in r)
    serve_control.set_weights({1: 1, 2: 1}, cfg)


def test_a_stats_loop_does_not_starve_the_router_syncs_of_a_rollout_step(serving: Serving) -> None:
    """Clients looping on ``GET /stats?since=0`` over a full book (200,000 answers for each of 4
    versions) while a rollout step moves the weights.
    The step returns about as fast as without them (its routers' syncs with the control actor stay on
    time), and the loop is answered 429 with Retry-After past its rate, the same shape as ever below it."""
    cfg = serving.cfg
    serve_control.set_weights({1: 1, 2: 0}, cfg)
    start = serve_control.reset_stats(cfg)
    control = ray.get_actor(cfg.control_actor_name, namespace=NAMESPACE)
    ray.get(
        control.__ray_call__.remote(
            lambda actor: actor._stats.record(
                (MODEL, v, start + i * 1e-6, 5.0 + i % 50, 0, True) for v in (1, 2, 3, 4) for i in range(200_000)
            )
        ),
        timeout=120,
    )
    lock = threading.Lock()
    statuses: Counter[int] = Counter()
    retry_after: set[str | None] = set()
    answered: list[dict[str, object]] = []
    done = threading.Event()

    def poll_stats(_: int) -> None:
        with client_of(serving) as client:
            while not done.is_set():
                response = client.get("/stats", params={"since": 0})
                with lock:
                    statuses[response.status_code] += 1
                    if response.status_code == 429:
                        retry_after.add(response.headers.get("retry-after"))
                    elif response.status_code == 200:
                        answered.append(response.json())
                done.wait(0.05)

    steps: list[float] = []
    with ClientThreads(poll_stats, 8, join_timeout_s=60):
        try:
            wait_for("the loop's first answers", lambda: sum(statuses.values()) >= 8, timeout_s=60)
            for weight in (10, 50, 100):
                began = time.monotonic()
                serve_control.set_weights({1: 100 - weight, 2: weight}, cfg, wait_s=20.0)
                steps.append(time.monotonic() - began)
        finally:
            done.set()
    print(f"rollout steps took {[round(s, 2) for s in steps]} s under the /stats loop; answers {dict(statuses)}")
    # a step waits for two syncs of each router (0.5 s apart): ~1 s here; 6-8 s when /stats scanned the samples
    assert max(steps) < 4.0, f"router syncs fell behind under the /stats loop: steps took {steps} s"
    assert set(statuses) == {200, 429} and statuses[429] > statuses[200], statuses
    assert retry_after and all(r is not None and r.isdigit() and int(r) >= 1 for r in retry_after), retry_after
    versions = answered[0]["versions"]
    assert isinstance(versions, dict) and {v: s["requests"] for v, s in versions.items()} == {
        str(v): 200_000 for v in (1, 2, 3, 4)
    }
    assert set(answered[0]) == {"model", "weights", "since", "versions"}
    serve_control.reset_stats(cfg)
