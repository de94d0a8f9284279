"""``rayline demo``: the whole lifecycle on the digits, then the outside-model walk."""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rayline import storage
from rayline.cli import ops, summaries
from rayline.cli.common import before_flow, reports_errors
from rayline.errors import RaylineError
from rayline.ray_workloads.registration.request import RegisterRequest
from rayline.ray_workloads.training.request import TrainRequest

if TYPE_CHECKING:  # for the types only: the flows load Prefect, Ray and torch, which `rayline --help` does without
    from rayline.flows.monitor import MonitorResult
    from rayline.flows.serve_rollout import RolloutResult
    from rayline.flows.train_model import TrainModelResult
    from rayline.models.registry import ModelVersion
    from rayline.ray_workloads.nightly.batch_inference import InferenceResult, NightSkipped
    from rayline.ray_workloads.nightly.request import BackfillResult
    from rayline.ray_workloads.quality.labels_import import LabelsImportResult
    from rayline.ray_workloads.registration.outside_models import RegisterModelResult

log = logging.getLogger(__name__)


@contextmanager
def _stage(name: str, times: dict[str, float]) -> Iterator[None]:
    """Time one stage of the demo into ``times`` and the log file: where a first run's minutes go."""
    started = time.perf_counter()
    try:
        yield
    finally:
        times[name] = time.perf_counter() - started
        log.info("demo stage %s took %.1f s", name, times[name])


@reports_errors
def demo(
    corrupt: Annotated[int, typer.Option(min=0, help="Broken objects mixed into the digits.")] = 4,
    tune_samples: Annotated[int, typer.Option(min=0, help="ASHA trials before training (0: no search).")] = 4,
    epochs: Annotated[int, typer.Option(min=1, help="Epochs of the tuned challenger's training run.")] = 12,
    baseline_epochs: Annotated[int, typer.Option(min=1, help="Epochs of the first, untuned champion.")] = 4,
    baseline_width: Annotated[int, typer.Option(min=1, help="Width of the first champion's CNN.")] = 8,
    soak_s: Annotated[float, typer.Option(min=0.1, help="Seconds each rollout step holds.")] = 5.0,
    photos: Annotated[int, typer.Option(min=0, help="Photos in the outside model's night (0: skip that walk).")] = 100,
) -> None:
    """The whole lifecycle on the digits: data, a first champion, a tuned challenger, serving with a
    canary rollout under load, and a night of batch inference; then an outside ResNet-18 registered,
    a night of photos predicted with it and one photo served."""
    started = time.perf_counter()
    before_flow()
    from rayline.flows.nightly_inference import NightRequest, nightly_inference
    from rayline.flows.train_model import train_model
    from rayline.seed import seed as write_seed
    from rayline.seed import seed_incoming
    from rayline.storage.layout import INCOMING_DIR, RAW_DIR, partition_for, yesterday_utc

    times: dict[str, float] = {}
    log.setLevel(logging.INFO)  # the stage times go to the log file (its handler takes every level)
    root = storage.storage_root()
    raw = storage.join(root, RAW_DIR)
    with _stage("seed", times):
        seeded = write_seed(raw, corrupt=corrupt)
    typer.echo(f"seeded {seeded.total} objects under {raw} ({seeded.written} new)")
    # A deliberately small first champion (0.83-0.88 test accuracy): at width 32 (0.96) the paired gate could
    # not tell it from the tuned challenger on 175 test images and would refuse the challenger, ending the
    # demo's story; its floor is low for the same reason.
    with _stage("baseline champion", times):
        first = TrainRequest(source_uri=raw, epochs=baseline_epochs, width=baseline_width, floor=0.6)
        baseline = train_model(first)
    typer.echo(f"baseline: {baseline.registration.decision.reason}")
    # The champion serves before the challenger trains, so the demo's rollout starts before the serve-rollout
    # deployment that registering the challenger triggers, which then waits for this one and finds it done.
    with _stage("serve the champion", times):
        serving = _serve_champion(baseline.registration.version.name)
    with _stage("tuned challenger", times):
        tuned = TrainRequest(source_uri=raw, tune_samples=tune_samples, epochs=epochs, promote_to="challenger")
        result = train_model(tuned)
    with _stage("roll out", times):
        rollout = _roll_out_under_load(result, serving, raw, soak_s)
    day = yesterday_utc()
    incoming = storage.join(root, INCOMING_DIR, partition_for(day))
    arrivals = seed_incoming(incoming, corrupt=corrupt)
    typer.echo(f"dropped {arrivals.total} arrivals under {incoming}")
    with _stage("nightly inference", times):
        # the version that is not champion now is scored in the night's shadow: the quality loop's first look
        shadow = _other_version(baseline.registration.version, result.registration.version)
        predictions = nightly_inference(NightRequest(date=day, shadow=shadow))
    with _stage("labels and quality", times):
        checked = _label_and_measure(root, day.isoformat(), check_serving=serving is not None)
    with _stage("outside model", times):
        # at most one broken photo in 19, within the night's default 5 % error budget, and 3 at most
        walk = _walk_outside_model(root, day, photos, corrupt=min(3, photos // 19)) if photos else None
    _print_story(result, rollout, predictions, checked, walk)
    _print_where_to_look(started, times)


def _print_story(
    trained: TrainModelResult,
    rollout: RolloutResult | None,
    night: InferenceResult | NightSkipped | BackfillResult,
    checked: tuple[LabelsImportResult, MonitorResult],
    walk: OutsideModelWalk | None,
) -> None:
    summaries.print_prepare_summary(trained.data)
    summaries.print_model_summary(trained)
    if rollout is not None:
        ops.print_rollout_summary(rollout)
    summaries.print_nightly_summary(night)
    _print_quality(*checked)
    if walk is not None:
        _print_walk(walk)


def _print_where_to_look(started: float, times: dict[str, float]) -> None:
    from rayline.lineage import lineage_dir

    typer.echo(f"  lineage records    {lineage_dir()}")
    typer.echo(f"  demo took          {(time.perf_counter() - started) / 60:.1f} min ({_slowest(times)})")
    api = os.environ.get("PREFECT_API_URL")
    typer.echo("")
    if api:
        typer.echo(f"Flow runs and artifacts: the Prefect UI of {api}")
    else:
        typer.echo("Flow runs and artifacts were recorded by Prefect's ephemeral API in ~/.prefect;")
        typer.echo("see them with `.venv/bin/prefect server start` and http://127.0.0.1:4200")


def _serve_champion(model_name: str) -> tuple[str, ModelVersion] | None:
    """Serve ``model_name``'s champion behind the router: its URL and version; None when it has no champion."""
    from rayline import ray_cluster
    from rayline.flows.serve_rollout import serve_config
    from rayline.models import registry
    from rayline.ray_workloads.serving import rollout

    if registry.alias_version(model_name, registry.CHAMPION) is None:
        return None
    ray_cluster.connect()
    champion = registry.resolve(model_name, registry.CHAMPION)
    return rollout.serve(champion, serve_config()), champion


def _roll_out_under_load(
    trained: TrainModelResult, serving: tuple[str, ModelVersion] | None, probe_uri: str, soak_s: float
) -> RolloutResult | None:
    """Keep a small load on the serving champion and canary the tuned challenger next to it."""
    import threading

    from rayline.errors import RolloutRolledBack
    from rayline.flows.serve_rollout import RolloutRequest, serve_rollout
    from rayline.models import registry
    from rayline.ray_workloads.serving import rollout

    candidate = trained.registration
    if candidate.alias != registry.CHALLENGER:
        typer.echo(f"no rollout: v{candidate.version.version} did not pass the gate ({candidate.decision.reason})")
        return None
    if serving is None:
        typer.echo(f"no rollout: no champion served before v{candidate.version.version} was registered")
        return None
    url, champion = serving
    typer.echo(f"serving v{champion.version} at {url}; rolling out v{candidate.version.version} under load")
    images = rollout.load_probe_images(probe_uri, 32, champion.image_spec)
    load, stop = rollout.ProbeClient(url, images, rps=10.0, model=champion.name), threading.Event()
    clients = threading.Thread(target=load.run_for, args=(3600.0, stop), daemon=True)
    clients.start()
    try:
        result = serve_rollout(RolloutRequest(candidate=registry.CHALLENGER, model_name=champion.name, soak_s=soak_s))
    except RolloutRolledBack as exc:
        typer.secho(f"rollout rolled back: {exc}", fg=typer.colors.YELLOW)
        result = None
    finally:
        stop.set()
        clients.join(timeout=60)
        load.close()
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(load.statuses.items()))
    typer.echo(
        f"load during the rollout: {load.sent} requests ({statuses}); connection errors: {load.connection_errors}"
    )
    for failure in load.first_failures:
        typer.secho(f"  failed request: {failure}", fg=typer.colors.YELLOW)
    return result


# Every fourth digit of the night (in key order) comes back labelled: people label a sample, not the whole
# night, chosen whatever the models answered, so the import says it is random and it may judge a challenger.
_LABELLED_EVERY = 4
_DIGIT_KEY = re.compile(r"(?P<label>\d)/digit-\d+\.png")


def _label_and_measure(root: str, day: str, check_serving: bool) -> tuple[LabelsImportResult, MonitorResult]:
    """The quality loop's first turn: people label a sample of the night's digits (a digit's folder is its
    class), the labels come back, and the monitor measures the version that predicted the night on them."""
    from rayline.flows.import_labels import LabelsImportRequest, import_labels
    from rayline.flows.monitor import MonitorRequest, monitor
    from rayline.ray_workloads.quality.requests import Selection
    from rayline.storage.layout import INCOMING_DIR, LABEL_IMPORTS_DIR, partition_for

    night = partition_for(date.fromisoformat(day))
    keys = sorted(o.key for o in storage.list_objects(storage.join(root, INCOMING_DIR, night)))
    digits = [(key, m["label"]) for key in keys if (m := _DIGIT_KEY.fullmatch(key))][::_LABELLED_EVERY]
    labels_uri = storage.join(root, LABEL_IMPORTS_DIR, "digits", f"demo-labels-{day}.csv")
    rows = "".join(f"{night}/{key},{label},demo\n" for key, label in digits)
    storage.write_bytes_atomic(labels_uri, f"key,label,source\n{rows}".encode())
    imported = import_labels(LabelsImportRequest(file=labels_uri, model_name="digits", selection=Selection.random))
    return imported, monitor(MonitorRequest(model_name="digits", check_serving=check_serving))


def _other_version(first: ModelVersion, second: ModelVersion) -> str | None:
    """Of the demo's two versions, the one that is not the champion now (``v<N>``); None if that is unknown."""
    from rayline.models import registry

    champion = registry.alias_version(first.name, registry.CHAMPION)
    others = [v.version for v in (first, second) if v.version != champion]
    return f"v{others[0]}" if champion is not None and len(others) == 1 else None


def _print_quality(imported: LabelsImportResult, checked: MonitorResult) -> None:
    typer.echo(f"  labels back        {imported.imported} labels imported into {imported.labels_table_uri}")
    for q in sorted(checked.quality, key=lambda q: q.role != "served"):
        what = "labelled accuracy" if q.role == "served" else "shadow's accuracy"
        typer.echo(
            f"  {what:<17}  dt={q.dt} digits v{q.model_version}: right on {q.correct} of {q.labelled} "
            f"({q.accuracy:.1%}), calibration error {q.ece:.3f}"
        )


def _slowest(times: dict[str, float]) -> str:
    """The stages that took most of the run, longest first: what to look at when a first run is slow."""
    ranked = sorted(times.items(), key=lambda item: -item[1])[:3]
    return ", ".join(f"{name} {seconds / 60:.1f}" for name, seconds in ranked)


# The outside-model walk: what a user who brings their own model does (README "Bring your model"), on the demo's
# embedded defaults. Their weights are a torchvision ResNet-18 built with ``weights=None``: nothing can be
# downloaded here.
OUTSIDE_MODEL = "photos"


@dataclass
class OutsideModelWalk:
    registration: RegisterModelResult
    night: InferenceResult
    served_url: str
    answer: dict[str, Any]


def save_user_weights(root: str) -> str:
    """The user's weights file: a ResNet-18 state dict (random weights)."""
    import torch
    import torchvision

    uri = storage.join(root, "user-models/resnet18-weights.pt")
    if not storage.exists(uri):
        torch.manual_seed(0)
        buffer = io.BytesIO()
        torch.save(torchvision.models.resnet18(weights=None).state_dict(), buffer)
        storage.write_bytes_atomic(uri, buffer.getvalue())
    return uri


def _walk_outside_model(root: str, day: date, photos: int, corrupt: int) -> OutsideModelWalk:
    """The user's ResNet registered with its ImageNet preprocessing as ``photos`` champion, a night of generated
    photos predicted with it, and one ``POST /models/photos/predict`` of a real photo answered."""
    import httpx

    from rayline import ray_cluster
    from rayline.flows.nightly_inference import NightRequest, nightly_inference
    from rayline.flows.register_model import register_model
    from rayline.flows.serve_rollout import serve_config
    from rayline.models import registry
    from rayline.ray_workloads.nightly.batch_inference import InferenceResult
    from rayline.ray_workloads.serving import rollout
    from rayline.seed import jpeg_bytes, source_photos
    from rayline.seed import seed as write_seed
    from rayline.storage.layout import partition_for

    weights = save_user_weights(root)
    typer.echo(f"saved a ResNet-18 (weights=None) as the user's weights: {weights}")
    asked = RegisterRequest(name=OUTSIDE_MODEL, arch="resnet18", weights_uri=weights, alias=registry.CHAMPION)
    registration = register_model(asked)
    incoming = storage.join(root, "incoming-photos", partition_for(day))
    seeded = write_seed(incoming, photos=photos, corrupt=corrupt, digits=False)
    typer.echo(f"dropped {seeded.total} photos under {incoming}")
    night = nightly_inference(NightRequest(date=day, model_name=OUTSIDE_MODEL, input_uri=incoming))
    if not isinstance(night, InferenceResult):  # one date: a night, unless another run committed it meanwhile
        raise RaylineError(f"the night of photos was not committed by this walk: {night}")
    ray_cluster.connect()
    url = rollout.serve(registration.version, serve_config())
    photo = jpeg_bytes(source_photos()[0])
    response = httpx.post(f"{url}{rollout.predict_path(OUTSIDE_MODEL)}", content=photo, timeout=60)
    return OutsideModelWalk(registration, night, url, response.raise_for_status().json())


def _print_walk(walk: OutsideModelWalk) -> None:
    version, night = walk.registration.version, walk.night
    summaries.heading("bring your own model")
    typer.echo(
        f"  registered         {version.name} v{version.version}: {version.model_spec.arch}, "
        f"{len(version.classes)} ImageNet classes, {version.image_spec.describe()}"
    )
    typer.echo(
        f"  night of photos    {night.inputs} inputs → {night.predictions} predictions + {night.errors} errors "
        f"in {night.elapsed_s:.1f}s"
    )
    typer.echo(f"  committed          {night.night} in {night.predictions_table} (version {night.predictions_version})")
    typer.echo(
        f"  POST {walk.served_url}{'/models/' + version.name + '/predict'}  a real photo → "
        f"{walk.answer.get('class_name')} ({walk.answer.get('confidence', 0.0):.3f}, random weights)"
    )
