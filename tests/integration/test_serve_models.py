"""One serving instance, several registered models: a digits CNN and an outside ImageNet ResNet side by side.

Each model has its own route, weights, stats and rollouts; ``/predict`` goes to the default
model. The module serves both on a free loopback port through the environment's settings
(so the ``rayline serve`` commands, run in-process with typer's runner, reach the same
instance), and its last test stops everything through the CLI.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from ray import serve
from typer.testing import CliRunner

from rayline import storage
from rayline.cli import app
from rayline.flows.serve_rollout import RolloutRequest, serve_config, serve_rollout
from rayline.models import registry
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.architectures.build import imagenet_classes
from rayline.ray_workloads.registration import mlflow_models
from rayline.ray_workloads.serving import control as serve_control
from rayline.ray_workloads.serving.http_api import ANSWER_HEADER, MODEL_HEADER
from rayline.ray_workloads.serving.rollout import GateConfig
from rayline.seed import digit_objects, jpeg_bytes, photo_objects, source_photos
from tests import mlflow_env
from tests.integration.helpers import ClientThreads, register_outside, register_untrained
from tests.support import free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

DIGITS = "digits-multi"
PHOTOS = "photos"


@dataclass
class Served:
    url: str
    digits: ModelVersion
    photos: ModelVersion
    probe_uri: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Both models at 100 % of their own traffic; digits deployed first, so it is the default."""
    root = str(tmp_path_factory.mktemp("serve-models") / "storage")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", root)
        env.setenv("RAYLINE_SERVE_PORT", str(free_port()))
        # a stopping replica looks every 2 s (Serve's default) whether it has drained: the rollout's
        # retirement and each `serve stop` waited at least that long for its replicas to go
        env.setenv("RAYLINE_SERVE_GRACEFUL_SHUTDOWN_WAIT_LOOP_S", "0.1")
        probes = storage.join(root, "photo-probes")
        for key, data in photo_objects(24, np.random.default_rng(0), large_share=0.0):
            storage.write_bytes_atomic(storage.join(probes, key), data)
        digits = register_untrained(DIGITS, class_prefix="digit-")
        photos = register_outside(PHOTOS, arch="resnet18", crop=64)
        cfg = serve_config()
        try:
            started = time.monotonic()
            url = serve_control.start(cfg)
            serve_control.deploy_versions([digits, photos], cfg)  # replicas start in parallel
            serve_control.set_weights({digits.version: 100.0}, cfg, model=DIGITS)
            serve_control.set_weights({photos.version: 100.0}, cfg, model=PHOTOS)
            print(f"two models served in {time.monotonic() - started:.1f} s")
            yield Served(url, digits, photos, probes)
        finally:
            serve_control.shutdown(cfg)


def _client(served: Served) -> httpx.Client:
    return httpx.Client(base_url=served.url, timeout=60, trust_env=False)


def _photo() -> bytes:
    return jpeg_bytes(source_photos()[0])


def _digit() -> bytes:
    return next(iter(digit_objects(32)))[1]


def test_two_models_answer_on_their_own_routes_and_predict_goes_to_the_default(served: Served) -> None:
    cfg = serve_config()
    serve_control.reset_stats(cfg, model=DIGITS)
    serve_control.reset_stats(cfg, model=PHOTOS)
    with _client(served) as client:
        photo = client.post(f"/models/{PHOTOS}/predict", content=_photo())
        assert photo.status_code == 200, photo.text
        answer = photo.json()
        assert answer["model"] == PHOTOS and answer["version"] == served.photos.version
        assert answer["class_name"] in imagenet_classes("resnet18") and len(answer["top_k"]) == 3
        assert photo.headers[MODEL_HEADER] == PHOTOS and photo.headers[ANSWER_HEADER] == str(served.photos.version)

        digit = client.post(f"/models/{DIGITS}/predict", content=_digit())
        assert digit.status_code == 200 and digit.json()["class_name"].startswith("digit-"), digit.text
        default = client.post("/predict", content=_digit())
        assert default.status_code == 200 and default.json()["model"] == DIGITS, default.text

        listed = client.get("/models").json()
        assert listed["default"] == DIGITS and set(listed["models"]) == {DIGITS, PHOTOS}
        assert listed["models"][PHOTOS]["weights"] == {str(served.photos.version): 100.0}
        # the routes of one model keep the shape they had when an instance served one model
        serve_control.stats(cfg, model=DIGITS)  # waits until every router has flushed its samples
        stats = client.get("/stats").json()
        assert stats["model"] == DIGITS and stats["versions"][str(served.digits.version)]["requests"] == 2
        photo_stats = client.get(f"/models/{PHOTOS}/stats").json()
        assert photo_stats["model"] == PHOTOS and photo_stats["versions"][str(served.photos.version)]["requests"] == 1
        assert client.get(f"/models/{PHOTOS}/healthz").json()["live_versions"] == [served.photos.version]

        unknown = client.post("/models/nope/predict", content=_photo())
        assert unknown.status_code == 404 and unknown.json()["error"] == "ModelNotServed"
        assert PHOTOS in unknown.json()["detail"] and DIGITS in unknown.json()["detail"]
        pinned = client.post(f"/models/{PHOTOS}/predict", content=_photo(), headers={"X-Rayline-Version": "9"})
        assert pinned.status_code == 404 and f"of {PHOTOS} is not live" in pinned.json()["detail"]

        serve_control.set_default_model(PHOTOS, cfg)  # what RAYLINE_SERVE_DEFAULT_MODEL does at start
        try:
            assert client.post("/predict", content=_photo()).json()["model"] == PHOTOS
            assert client.get("/stats").json()["model"] == PHOTOS
        finally:
            serve_control.set_default_model(None, cfg)
        assert client.post("/predict", content=_digit()).json()["model"] == DIGITS
    assert serve_control.stats(cfg, model=PHOTOS)[served.photos.version].requests == 2
    assert serve_control.stats(cfg, model=DIGITS)[served.digits.version].requests == 3


MIB = 1024 * 1024
STALL_BUDGET_MS = 50.0  # what a bad body may add to other requests' p99


def _many_parts(size: int) -> bytes:
    """A multipart body of ``size`` bytes, all tiny parts: ~190k headers to parse."""
    part = b'--b\r\nContent-Disposition: form-data; name="f"\r\n\r\n\r\n'
    return part * ((size - 9) // len(part)) + b"--b--\r\n"


class _BigBodies(ClientThreads):
    """One client sending big bodies back to back, alternating ``kinds`` every ``slice_s``:
    each answer as "<status> <error>: <detail>" and when it was in flight, by kind."""

    def __init__(self, served: Served, kinds: dict[str, tuple[bytes, str]], slice_s: float) -> None:
        self.served, self.kinds, self.slice_s = served, kinds, slice_s
        self.sent: list[tuple[str, float, float, str]] = []  # kind, started, finished, answer
        super().__init__(self._loop, 1, join_timeout_s=60)

    def _loop(self, _: int) -> None:
        names = list(self.kinds)
        with _client(self.served) as client:
            while not self.stop.is_set():
                kind = names[int(time.monotonic() / self.slice_s) % len(names)]
                body, content_type = self.kinds[kind]
                started = time.monotonic()
                answer = client.post(f"/models/{DIGITS}/predict", content=body, headers={"content-type": content_type})
                detail = f"{answer.status_code} {answer.json()['error']}: {answer.json()['detail']}"
                self.sent.append((kind, started, time.monotonic(), detail))


def _small_requests(
    served: Served, enough: Callable[[list[tuple[float, float]]], bool], cap_s: float
) -> list[tuple[float, float]]:
    """Small predictions one after another until ``enough`` of them (or ``cap_s``); when each was in flight."""
    small: list[tuple[float, float]] = []
    digit = _digit()
    deadline = time.monotonic() + cap_s
    with _client(served) as client:
        while time.monotonic() < deadline and not enough(small):
            started = time.monotonic()
            assert client.post(f"/models/{DIGITS}/predict", content=digit).status_code == 200
            small.append((started, time.monotonic()))
    return small


def _by_kind(
    small: list[tuple[float, float]], sent: list[tuple[str, float, float, str]], kinds: Iterable[str]
) -> dict[str, list[tuple[float, float]]]:
    """The small requests that overlapped big bodies of one kind only, by that kind."""
    out: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    big = list(sent)  # the sender appends meanwhile
    for start, end in small:
        overlapped = {kind for kind, s, e, _ in big if start < e and end > s}
        if len(overlapped) == 1:
            out[overlapped.pop()].append((start, end))
    return out


def _p99_ms(requests: list[tuple[float, float]]) -> float:
    return float(np.percentile([(end - start) * 1000 for start, end in requests], 99))


def test_the_champion_in_mlflow_loads_and_serves_without_rayline_answering_as_predict(
    served: Served, mlflow_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served champion, mirrored to MLflow, in a virtualenv of its requirements alone (no rayline, no torch):
    ``load_model("models:/photos@champion")`` and ``mlflow models serve``'s ``/invocations`` give the photo the
    class that rayline's ``/predict`` gives it."""
    pins = mlflow_env.requirements()
    python = mlflow_env.python(pins)
    assert python is not None, f"make the environment of {pins} first: .venv/bin/python -m tests.mlflow_env"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    champion = registry.alias_version(PHOTOS, registry.CHAMPION)
    report = mlflow_models.reconcile(PHOTOS)
    assert report is not None and report.aliases[registry.CHAMPION] == champion, report
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(_photo())
    uri = f"models:/{PHOTOS}@champion"
    with mlflow_env.model_server(python, uri, mlflow_uri, tmp_path) as url:
        loaded = mlflow_env.predict_in(python, uri, photo, mlflow_uri)  # meanwhile the server starts
        mlflow_env.wait_until_serving(url, tmp_path)
        body = {"dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(photo.read_bytes()).decode()]]}}
        invocation = httpx.post(f"{url}/invocations", json=body, timeout=120, trust_env=False)
    assert invocation.status_code == 200, invocation.text
    served_by_mlflow = invocation.json()["predictions"][0]
    with _client(served) as client:
        pinned = {"X-Rayline-Version": str(champion)}
        predict = client.post(f"/models/{PHOTOS}/predict", content=photo.read_bytes(), headers=pinned)
    assert predict.status_code == 200, predict.text
    answer = predict.json()
    assert loaded["class_name"] == served_by_mlflow["class_name"] == answer["class_name"], (loaded, answer)
    assert loaded["class_index"] == served_by_mlflow["class_index"] == answer["class_index"]
    assert served_by_mlflow["confidence"] == pytest.approx(loaded["confidence"], rel=1e-6)
    assert [c["name"] for c in loaded["inputs"]] == ["image"] and loaded["inputs"][0]["type"] == "binary"
    assert {"class_index", "class_name", "confidence", "top_classes", "top_confidences"} <= set(loaded["outputs"])


def test_a_many_part_body_is_refused_without_stalling_the_router(served: Served) -> None:
    """10 MiB of tiny multipart parts: a 400 before any part is parsed, and the router's other
    requests meanwhile are no more than 50 ms slower at p99.

    This instance runs the defaults (one router replica, 10 MiB bodies), so every request
    shares the big ones' router. The 50 ms are measured on the same client against the same
    body refused *unparsed* (its content type without the boundary): moving 10 MiB through
    Serve's proxy on a 2-core machine costs the neighbours what it costs either way, and what
    is under test is what the parsing adds. The two kinds alternate every half second, so a
    change in the machine's load weighs on both alike; a small request counts for the kind
    it overlapped (neither, if it overlapped both).
    """
    size = 10 * MIB - 1024  # under the 10 MiB body limit: refused for its parts, not its size
    many = _many_parts(size)
    kinds = {"unparsed": (many, "multipart/form-data"), "parts": (many, "multipart/form-data; boundary=b")}
    idle = _small_requests(served, lambda done: len(done) >= 60, cap_s=5.0)
    # a second look only when the first is over budget: other processes on 2 cores move a p99
    # of 200 requests by tens of ms either way, while a stalled loop (the unbounded parser
    # took ~6 s per body) fails every look
    for attempt in (1, 2):
        p99, counts, answers = _stall_measured(served, kinds)
        print(
            f"attempt {attempt}: small requests' p99 idle {_p99_ms(idle):.1f} ms; next to 10 MiB refused unparsed "
            f"{p99['unparsed']:.1f} ms, next to 10 MiB of tiny parts {p99['parts']:.1f} ms ({counts} small requests, "
            f"{ {k: len(a) for k, a in answers.items()} } big bodies)"
        )
        assert all(
            a.startswith("400 BadMultipart: multipart/form-data without a boundary") for a in answers["unparsed"]
        )
        refused = "400 BadMultipart: multipart body has more than 16 parts (the limit)"
        assert answers["parts"] and all(a == refused for a in answers["parts"]), answers["parts"][:3]
        assert min(counts.values()) >= 100, f"too few small requests to measure: {counts}"
        if p99["parts"] <= p99["unparsed"] + STALL_BUDGET_MS:
            break
    assert p99["parts"] <= p99["unparsed"] + STALL_BUDGET_MS, f"a many-part body delayed other requests: {p99}"


def _stall_measured(
    served: Served, kinds: dict[str, tuple[bytes, str]]
) -> tuple[dict[str, float], dict[str, int], dict[str, list[str]]]:
    """p99 (ms) of small requests next to each kind of big body, how many were measured, the big answers."""
    with _BigBodies(served, kinds, slice_s=0.5) as big:
        # checked every 50 requests: 200 small requests per kind, so that p99 is not just the slowest one;
        # CI's loaded 2 cores measured 93 and 83 in 30 s, so the cap is what a slow machine needs for 100
        small = _small_requests(
            served,
            lambda done: not len(done) % 50 and all(len(r) >= 200 for r in _by_kind(done, big.sent, kinds).values()),
            cap_s=75.0,
        )
    by_kind = _by_kind(small, big.sent, kinds)
    answers = {kind: [a for k, *_, a in big.sent if k == kind] for kind in kinds}
    p99 = {kind: _p99_ms(r) if r else float("nan") for kind, r in by_kind.items()}
    return p99, {kind: len(r) for kind, r in by_kind.items()}, answers


def test_canary_rollout_of_the_outside_model_leaves_the_other_model_alone(served: Served) -> None:
    cfg = serve_config()
    twin = register_outside(PHOTOS, arch="resnet18", crop=64, seed=0, alias=registry.CHALLENGER)
    digits_before = (serve_control.get_weights(cfg, model=DIGITS), serve_control.replica_pids(cfg))
    with _client(served) as client:
        answer_before = client.post(f"/models/{DIGITS}/predict", content=_digit()).json()["top_k"]

    started = time.monotonic()
    request = RolloutRequest(
        candidate=registry.CHALLENGER,
        model_name=PHOTOS,
        steps=[50.0, 100.0],
        soak_s=2.0,
        gates=GateConfig(min_requests=10),
        probe_uri=served.probe_uri,
        probe_images=8,  # of the 24 probes: each pinned to both versions, one after another, for agreement
    )
    result = serve_rollout(request)
    print(f"photos rollout in {time.monotonic() - started:.1f} s: {result.reason}")

    assert result.promoted and result.model == PHOTOS and result.candidate == twin.version
    assert result.incumbent == served.photos.version and result.steps[0].agreement == 1.0
    assert registry.alias_version(PHOTOS, registry.CHAMPION) == twin.version
    assert serve_control.get_weights(cfg, model=PHOTOS) == {twin.version: 100.0}
    digits_app = cfg.version_app(DIGITS, served.digits.version)
    weights_after, pids_after = serve_control.get_weights(cfg, model=DIGITS), serve_control.replica_pids(cfg)
    assert weights_after == digits_before[0] and pids_after[digits_app] == digits_before[1][digits_app]
    assert registry.alias_version(DIGITS, registry.CHAMPION) is None, "the rollout moved no other model's alias"
    with _client(served) as client:
        assert client.post(f"/models/{DIGITS}/predict", content=_digit()).json()["top_k"] == answer_before
        photo = client.post(f"/models/{PHOTOS}/predict", content=_photo())
        assert photo.status_code == 200 and photo.json()["version"] == twin.version


def test_serve_stop_and_start_through_the_cli(served: Served) -> None:
    runner = CliRunner()
    stopped = runner.invoke(app, ["serve", "stop", "--model", PHOTOS])
    assert stopped.exit_code == 0, stopped.output
    assert f"stopped {PHOTOS}" in stopped.output and f"still served: {DIGITS}" in stopped.output
    with _client(served) as client:
        assert client.post(f"/models/{PHOTOS}/predict", content=_photo()).status_code == 404
        assert client.post("/predict", content=_digit()).json()["model"] == DIGITS, "the other model still answers"

    bad = runner.invoke(app, ["serve", "start", "--model", f"{PHOTOS}@nope"])
    assert bad.exit_code == 3 and "has no 'nope' alias" in bad.output, bad.output

    started = runner.invoke(app, ["serve", "start", "--model", PHOTOS])  # its champion: the promoted twin
    assert started.exit_code == 0, started.output
    champion = registry.alias_version(PHOTOS, registry.CHAMPION)
    assert f"{PHOTOS} v{champion} (champion) deployed: 100%" in started.output
    assert "embedded Ray cluster" in started.output
    with _client(served) as client:
        photo = client.post(f"/models/{PHOTOS}/predict", content=_photo())
        assert photo.status_code == 200 and photo.json()["version"] == champion

    status = runner.invoke(app, ["serve", "status"])
    assert status.exit_code == 0, status.output
    assert f"serving {DIGITS} at" in status.output and "(default: POST /predict)" in status.output
    assert f"serving {PHOTOS} at" in status.output

    everything = runner.invoke(app, ["serve", "stop"])
    assert everything.exit_code == 0, everything.output
    cfg = serve_config()
    left = [a for a in serve.status().applications if a == cfg.name or a.startswith(f"{cfg.name}-")]
    assert left == [], f"still deployed after `rayline serve stop`: {left}"
