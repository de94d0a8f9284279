"""Execution plans kept with the model version they were chosen for, per machine, libraries and policy.

A plan is measured once per (version, CPU model and instruction sets, GPU,
torch version, policy) and stored as ``<version>/plans/<key>.json``. The
first actor to finish measuring creates the file exclusively; an actor that
loses that race, and every later actor, restart, rerun or node of the same
kind, reads it and runs the same plan. So the rows of a night, and of its
rerun, are predicted by one plan, not by whichever plan each actor's timing
happened to favour.

The cache is an optimisation: a store that cannot be written is logged and
the measured plan is used; a record that cannot be read is named in the log
and measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ray_workloads.execution.plan import PROBE_IMAGES, PlanChoice, PlanPolicy
from ray_workloads.images import decode_image
from rayline import storage
from rayline.errors import StorageError
from rayline.hardware import Hardware, detect
from rayline.specs import ImageSpec
from rayline.storage import conditional

if TYPE_CHECKING:
    from ray_workloads.model_interface import LoadedModel

logger = logging.getLogger(__name__)

PLANS_DIR = "plans"


def libraries() -> dict[str, str]:
    """The versions a plan's speed and answers depend on."""
    import torch

    return {"torch": torch.__version__}


def plan_key(hardware: Hardware, policy: PlanPolicy, versions: dict[str, str]) -> str:
    """A short name for what a plan was chosen on: the same key means the same choice applies."""
    described = {"hardware": hardware.as_record(), "policy": policy.model_dump(mode="json"), "libraries": versions}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def plan_uri(version_uri: str, key: str) -> str:
    return storage.join(version_uri, PLANS_DIR, f"{key}.json")


def cached_plan(uri: str) -> PlanChoice | None:
    """The plan stored at ``uri``; None when there is none or it cannot be read (logged)."""
    try:
        found = conditional.read_versioned(uri)
    except (OSError, StorageError) as exc:
        logger.warning("could not read the cached execution plan %s (%s): measuring", uri, exc)
        return None
    if found is None:
        return None
    try:
        return PlanChoice.from_record(json.loads(found.data))
    except ValueError as exc:
        logger.warning("the cached execution plan %s is not a plan (%s): measuring", uri, exc)
        return None


def store_plan(uri: str, choice: PlanChoice, extra: dict[str, Any]) -> PlanChoice:
    """Store ``choice`` unless another actor stored one first: the plan every actor then runs."""
    record = {**choice.record(), **extra}
    try:
        created = conditional.create_exclusive(uri, json.dumps(record, indent=2, sort_keys=True).encode())
    except (OSError, StorageError) as exc:
        logger.warning("could not cache the execution plan at %s (%s): using it uncached", uri, exc)
        return choice
    if created is not None:
        return choice
    return cached_plan(uri) or choice


def plan_for(model: LoadedModel, version_uri: str, probe: np.ndarray, policy: PlanPolicy) -> PlanChoice:
    """Adopt this version's cached plan for this machine, or choose one on ``probe`` and cache it."""
    hardware = detect()
    if policy.mode == "off" or model.module is None:
        choice = model.choose_plan(probe, policy, hardware)
        logger.info("execution plan of %s: %s", model.spec.describe(), choice.reason)
        return choice
    versions = libraries()
    key = plan_key(hardware, policy, versions)
    uri = plan_uri(version_uri, key)
    found = cached_plan(uri)
    if found is not None:
        adopted = model.adopt(found, _artifact_uri(version_uri, found))
        logger.info("execution plan of %s (cached at %s): %s", model.spec.describe(), uri, adopted.reason)
        return adopted
    measured = model.choose_plan(probe, policy, hardware)
    logger.info("execution plan of %s: %s", model.spec.describe(), measured.reason)
    if model.converted is not None and measured.plan.backend == "openvino":
        measured = _store_converted(model, version_uri, key, measured)
        if measured.artifact is None:  # a plan whose model is not stored would fail every other actor: not cached
            return measured
    stored = store_plan(uri, measured, {"libraries": versions, "policy": policy.model_dump(mode="json")})
    return measured if stored is measured else model.adopt(stored, _artifact_uri(version_uri, stored))


def _artifact_uri(version_uri: str, choice: PlanChoice) -> str | None:
    return None if choice.artifact is None else storage.join(version_uri, choice.artifact)


def _store_converted(model: LoadedModel, version_uri: str, key: str, choice: PlanChoice) -> PlanChoice:
    """Store the converted model of ``choice`` in a folder of this actor's own (two actors measuring at once
    never mix their files); the choice naming it, or without it where it cannot be stored (logged)."""
    assert model.converted is not None
    artifact = "/".join((PLANS_DIR, key, uuid.uuid4().hex))
    try:
        model.converted.save(storage.join(version_uri, artifact))
    except (OSError, StorageError) as exc:
        logger.warning("could not store the %s plan's model under %s (%s)", choice.plan.name, version_uri, exc)
        return choice
    return replace(choice, artifact=artifact)


def sample_probe(image_spec: ImageSpec, count: int = PROBE_IMAGES) -> np.ndarray:
    """Real photos to choose a plan on where no night's images are at hand (a serving replica's start).

    Views of scikit-learn's two sample photos (offline), decoded as the
    version decodes its inputs: their logits are a real image's, unlike a
    blank or random probe's, which sit near a tie and say little about a
    plan's answers. A night's plan, cached first, was chosen on its own images.
    """
    from rayline.seed import photo_variant, source_photos

    photos, rng = source_photos(), np.random.default_rng(0)
    views = (photo_variant(photos[i % len(photos)], rng)[0] for i in range(count))
    return np.stack([decode_image(view, image_spec) for view in views])
