"""The demo's outside-model walk: what a user who brings their own model does (README "Bring your model").

A torchvision ResNet-18 built with ``weights=None`` saved as "the user's weights" (nothing can be downloaded
here), registered with its ImageNet preprocessing as ``photos`` champion, a night of generated photos
predicted with it, and one ``POST /models/photos/predict`` of a real photo answered.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import date
from typing import TYPE_CHECKING, Any

import typer

from rayline import storage
from rayline.errors import RaylineError
from rayline.ray_workloads.registration.request import RegisterRequest

if TYPE_CHECKING:  # for the types only: the workloads load Ray and torch, which `rayline --help` does without
    from rayline.ray_workloads.nightly.batch_inference import InferenceResult
    from rayline.ray_workloads.registration.outside_models import RegisterModelResult

OUTSIDE_MODEL = "photos"
OUTSIDE_ARCH = "resnet18"
USER_WEIGHTS = "user-models/resnet18-weights.pt"
PHOTOS_INCOMING = "incoming-photos"


@dataclass
class OutsideModelWalk:
    registration: RegisterModelResult
    night: InferenceResult
    served_url: str
    answer: dict[str, Any]


def save_user_weights(root: str) -> str:
    """The user's weights file: a ResNet-18 state dict (random weights; nothing can be downloaded here)."""
    import torch
    import torchvision

    uri = storage.join(root, USER_WEIGHTS)
    if not storage.exists(uri):
        torch.manual_seed(0)
        buffer = io.BytesIO()
        torch.save(torchvision.models.resnet18(weights=None).state_dict(), buffer)
        storage.write_bytes_atomic(uri, buffer.getvalue())
    return uri


def walk(root: str, day: date, photos: int, corrupt: int) -> OutsideModelWalk:
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
    asked = RegisterRequest(name=OUTSIDE_MODEL, arch=OUTSIDE_ARCH, weights_uri=weights, alias=registry.CHAMPION)
    registration = register_model(asked)
    incoming = storage.join(root, PHOTOS_INCOMING, partition_for(day))
    seeded = write_seed(incoming, photos=photos, corrupt=corrupt, digits=False)
    typer.echo(f"dropped {seeded.total} photos under {incoming}")
    night = nightly_inference(NightRequest(date=day, model_name=OUTSIDE_MODEL, input_uri=incoming))
    if not isinstance(night, InferenceResult):  # one date: a night, unless another run committed it meanwhile
        raise RaylineError(f"the night of photos was not committed by this walk: {night}")
    ray_cluster.connect()
    url = rollout.serve(registration.version, serve_config())
    answer = _predict(url, jpeg_bytes(source_photos()[0]))
    return OutsideModelWalk(registration=registration, night=night, served_url=url, answer=answer)


def _predict(url: str, photo: bytes) -> dict[str, Any]:
    import httpx

    from rayline.ray_workloads.serving import rollout

    response = httpx.post(f"{url}{rollout.predict_path(OUTSIDE_MODEL)}", content=photo, timeout=60)
    answer: dict[str, Any] = response.raise_for_status().json()
    return answer


def print_walk(walk: OutsideModelWalk) -> None:
    version, night = walk.registration.version, walk.night
    typer.echo("")
    typer.secho("bring your own model", bold=True)
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
