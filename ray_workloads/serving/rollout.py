"""Canary rollout behind the weighted router: step the candidate's weight, soak, judge, then promote or roll back.

Each step sets the candidate's share of the model's traffic and holds it for a soak window while
canary probes (real images sent through the router, like any client) run beside any live traffic;
the candidate is then judged on the window's per-version stats:

* error rate (5xx answers of the candidate) at most ``max_error_rate``;
* p95 latency at most ``max_p95_ratio`` × the incumbent's (+ a small absolute slack: ratios of
  millisecond latencies are mostly noise);
* at the first step, agreement with the incumbent on the same images (each sent pinned to both
  versions) at least ``min_agreement``;
* at least ``min_requests`` answers from the candidate: no evidence, no promotion.

Only requests the router routed by weight (the probes and live traffic) and not answered 4xx count
toward a window: ``stats`` says why.

The incumbent is the version of the candidate's model serving the largest share now (deployed at
100 % first when nothing of that model serves). Every request, weight and stats window here is the
model's own (``/models/<name>/predict``, ``model=`` on ``control``): other models are never touched.
Nothing here touches the registry or Prefect: ``canary`` moves aliases, the serve tasks record the outcome.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable

import httpx
from pydantic import BaseModel

from rayline import storage
from rayline.errors import ConfigError, ImageDecodeError, InputDataError
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.data.images import ImageSpec, decode_image
from rayline.ray_workloads.serving import control
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.ray_workloads.serving.control import VersionStats
from rayline.ray_workloads.serving.http_api import VERSION_HEADER
from rayline.ray_workloads.serving.rollout_config import Canary as Canary  # the stage's config, declared apart
from rayline.ray_workloads.serving.rollout_config import GateConfig as GateConfig
from rayline.ray_workloads.serving.rollout_config import RolloutConfig as RolloutConfig
from rayline.storage import fetching
from rayline.storage.fencing import Fence
from rayline.storage.layout import RAW_DIR


def predict_path(model: str | None) -> str:
    """The router's predict route for ``model`` (None: the default model's ``/predict``)."""
    return "/predict" if model is None else f"/models/{model}/predict"


class StepReport(BaseModel):
    weight: float
    candidate: VersionStats | None
    incumbent: VersionStats | None
    incumbent_p95_ms: float | None
    agreement: float | None
    passed: bool
    reason: str


def judge(
    candidate: VersionStats | None,
    incumbent_p95_ms: float | None,
    agreement: float | None,
    gates: GateConfig,
) -> tuple[bool, str]:
    """One window's verdict on the candidate, with the reason in words."""
    if agreement is not None and agreement < gates.min_agreement:
        return False, f"agreement with the incumbent {agreement:.1%} is below {gates.min_agreement:.1%}"
    if candidate is None or candidate.requests < gates.min_requests:
        seen = candidate.requests if candidate else 0
        return False, f"only {seen} candidate requests in the window (need {gates.min_requests}) — no evidence"
    if candidate.error_rate > gates.max_error_rate:
        return False, (
            f"error rate {candidate.error_rate:.1%} ({candidate.errors}/{candidate.requests}) "
            f"is above {gates.max_error_rate:.1%}"
        )
    if incumbent_p95_ms is not None and candidate.p95_ms is not None:
        bound = incumbent_p95_ms * gates.max_p95_ratio + gates.p95_slack_ms
        if candidate.p95_ms > bound:
            return False, (
                f"p95 latency {candidate.p95_ms:.1f} ms is above {bound:.1f} ms "
                f"({gates.max_p95_ratio}× the incumbent's {incumbent_p95_ms:.1f} ms + {gates.p95_slack_ms} ms)"
            )
    return True, (
        f"{candidate.requests} requests, error rate {candidate.error_rate:.1%}, p95 "
        f"{candidate.p95_ms if candidate.p95_ms is None else round(candidate.p95_ms, 1)} ms"
        + (f", agreement {agreement:.1%}" if agreement is not None else "")
    )


def default_probe_source(version: ModelVersion, root: str) -> str:
    """Images like the ones ``version`` serves, for canary probes when none are named: the prefix its
    training data came from (``raw/`` when its data manifest is gone), else the inputs of its latest
    committed night."""
    from rayline.ray_workloads.data import preprocess  # the rollout's own imports stay light
    from rayline.tables.prediction_reads import latest_night_commit

    if version.data_manifest_uri is not None:
        if storage.exists(version.data_manifest_uri):
            return preprocess.source_of(version.data_manifest_uri)
        return storage.join(root, RAW_DIR)
    latest = latest_night_commit(root, version.name)
    if latest is not None and latest.input_uri is not None:
        return latest.input_uri
    raise ConfigError(
        f"{version.name} v{version.version} was not trained here and has no committed night to take probe "
        "images from: pass probe_uri (a prefix of images like the ones it serves)"
    )


def load_probe_images(uri: str, count: int, spec: ImageSpec) -> list[bytes]:
    """Up to ``count`` decodable images under ``uri`` (sorted by key: the same set every run)."""
    objects = sorted(storage.list_objects(uri), key=lambda o: o.key)
    images: list[bytes] = []
    for fetched in fetching.fetch_many([o.uri for o in objects[: count * 2]], concurrency=16):
        if fetched.error is None and fetched.data is not None:
            try:
                decode_image(fetched.data, spec)
            except ImageDecodeError:
                continue
            images.append(fetched.data)
        if len(images) == count:
            break
    if not images:
        raise InputDataError(f"no decodable probe images under {uri}")
    return images


def incumbent_version(cfg: ServeConfig, model: str | None = None) -> int | None:
    """``model``'s live version with the largest share of traffic (routers route by it already), if any serves."""
    weights = {v: w for v, w in control.get_weights(cfg, model=model, settled=True).items() if w > 0}
    return max(weights, key=lambda v: weights[v]) if weights else None


def restore(champion: ModelVersion, remove: Iterable[int], cfg: ServeConfig, fence: Fence | None = None) -> None:
    """All of ``champion``'s model's traffic on ``champion`` (deployed first if it was retired), then the
    versions in ``remove`` go: what a rollout that did not finish left is undone."""
    control.deploy_version(champion, cfg, fence=fence)
    control.set_weights({champion.version: 100.0}, cfg, model=champion.name, fence=fence)
    for version in remove:
        control.remove_version(version, cfg, model=champion.name, fence=fence)


def serve(version: ModelVersion, cfg: ServeConfig, fence: Fence | None = None) -> str:
    """Make sure ``version`` is deployed; it takes all traffic if nothing of its model serves yet. The base URL.
    ``fence``: the rollout lease's fencing token (``control``), None outside a rollout."""
    base_url = control.start(cfg)
    control.deploy_version(version, cfg, fence=fence)
    if incumbent_version(cfg, version.name) is None:
        control.set_weights({version.version: 100.0}, cfg, model=version.name, fence=fence)
    return base_url


def prepare(incumbent: ModelVersion, candidate: ModelVersion, cfg: ServeConfig, fence: Fence | None = None) -> str:
    """Serve the incumbent and deploy the candidate at 0%; the base URL."""
    base_url = serve(incumbent, cfg, fence)
    control.deploy_version(candidate, cfg, fence=fence)
    return base_url


def agreement(
    base_url: str, images: Iterable[bytes], incumbent: int, candidate: int, model: str | None = None
) -> float:
    """Fraction of images on which both versions of ``model`` (each pinned) predict the same class."""
    same = compared = 0
    path = predict_path(model)
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        for image in images:
            answers = [
                client.post(path, content=image, headers={VERSION_HEADER: str(v)}) for v in (incumbent, candidate)
            ]
            if all(a.status_code == 200 for a in answers):
                compared += 1
                same += answers[0].json()["class_index"] == answers[1].json()["class_index"]
            elif answers[0].status_code == 200:
                compared += 1  # the candidate failed where the incumbent answered: a disagreement
    return same / compared if compared else 0.0


class ProbeClient:
    """Paced requests through the router, tallied by status: the rollout's canary probes, the demo's load.
    Unpinned, they follow ``model``'s weights like any client, which is what makes them count toward the
    gate (``stats``): a marker header letting probes in would be as easy for any client to send."""

    def __init__(self, base_url: str, images: list[bytes], rps: float, model: str | None = None) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=30.0)
        self.path = predict_path(model)
        self.images = images
        self.interval = 1.0 / rps if rps > 0 else None
        self.sent = 0
        self.statuses: Counter[int] = Counter()
        self.connection_errors = 0
        self.first_failures: list[str] = []  # what the first few failed requests got, for the report

    def run_for(self, seconds: float, stop: threading.Event | None = None) -> None:
        if self.interval is None:
            time.sleep(seconds)
            return
        started, n = time.monotonic(), 0
        while time.monotonic() - started < seconds and not (stop and stop.is_set()):
            try:
                answer = self.client.post(self.path, content=self.images[self.sent % len(self.images)])
                self.statuses[answer.status_code] += 1
                if answer.status_code >= 400:
                    self._note_failure(f"{answer.status_code} {answer.text[:200]}")
            except httpx.HTTPError as exc:
                self.connection_errors += 1  # the router's stats are the gate's record; this is the client's
                self._note_failure(f"{type(exc).__name__}: {exc}")
            self.sent, n = self.sent + 1, n + 1
            time.sleep(max(0.0, started + n * self.interval - time.monotonic()))

    def _note_failure(self, what: str) -> None:
        if len(self.first_failures) < 5:
            self.first_failures.append(what)

    def close(self) -> None:
        self.client.close()


def soak(
    cfg: RolloutConfig, base_url: str, images: list[bytes], candidate: int, model: str | None = None
) -> dict[int, VersionStats]:
    """Hold the current weights for ``soak_s`` (longer, up to 3×, until the candidate has
    ``min_requests`` answers); the window's per-version stats of ``model``."""
    window_start = time.time()
    probes = ProbeClient(base_url, images, cfg.probe_rps, model)
    started = time.monotonic()
    try:
        probes.run_for(cfg.soak_s)
        while True:
            # waits for every router's flush; only routed, non-4xx answers: what clients pin to the
            # candidate (or junk it refuses) is no evidence about it
            window = control.stats(cfg.serve, model=model, since=window_start, gated=True)
            seen = window.get(candidate)
            enough = seen is not None and seen.requests >= cfg.gates.min_requests
            if enough or time.monotonic() - started >= 3 * cfg.soak_s:
                return window
            probes.run_for(1.0)
    finally:
        probes.close()


def run_step(
    cfg: RolloutConfig,
    base_url: str,
    incumbent: int,
    candidate: int,
    weight: float,
    images: list[bytes],
    incumbent_p95_ms: float | None,
    check_agreement: bool,
    model: str | None = None,
    fence: Fence | None = None,
) -> StepReport:
    """Give the candidate ``weight`` % of ``model``'s traffic, soak, and judge the window."""
    agreed = agreement(base_url, images, incumbent, candidate, model) if check_agreement else None
    window: dict[int, VersionStats] = {}
    if agreed is None or agreed >= cfg.gates.min_agreement:  # no live traffic for a model that disagrees
        control.set_weights({incumbent: 100.0 - weight, candidate: weight}, cfg.serve, model=model, fence=fence)
        window = soak(cfg, base_url, images, candidate, model)
    seen = window.get(incumbent)
    if seen is not None and seen.p95_ms is not None and seen.requests >= cfg.gates.min_requests:
        incumbent_p95_ms = seen.p95_ms  # the freshest baseline; at 100% the last one stands
    passed, reason = judge(window.get(candidate), incumbent_p95_ms, agreed, cfg.gates)
    return StepReport(
        weight=weight,
        candidate=window.get(candidate),
        incumbent=seen,
        incumbent_p95_ms=incumbent_p95_ms,
        agreement=agreed,
        passed=passed,
        reason=reason,
    )


def retire(old: int, new: int, cfg: ServeConfig, model: str | None = None, fence: Fence | None = None) -> None:
    """``new`` takes all of ``model``'s traffic, then ``old``'s deployment goes: the old incumbent after a
    promotion, the candidate after a roll-back."""
    control.set_weights({new: 100.0}, cfg, model=model, fence=fence)
    control.remove_version(old, cfg, model=model, fence=fence)
