"""Execution plans kept with the model version they were chosen for, per machine, libraries and policy.

A plan is measured once per (version, CPU model and instruction sets, GPU, torch version, policy) and stored
as ``<version>/plans/<key>.json``, created exclusively: every later actor, rerun or node of the same kind
runs that plan, so the rows of a night and of its rerun come from one plan, not from whichever each actor's
timing favoured. One actor measures, holding ``<key>.measuring``; the others wait rather than time
candidates on the same cores (which skews the timings). A claim older than ``MEASURE_WAIT_S`` is taken over,
and a waiter that sees no plan by then measures itself: a lost claimant costs time, never the night.

A night that fell back to fp32 too often (execution.fallback) replaces the plan file, conditionally, by an
fp32 record naming what it replaced and why (:func:`demote`). The cache is an optimisation: a store that
cannot be written or read is logged, and the plan is used uncached or measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rayline import storage
from rayline.errors import ConfigError, StorageError
from rayline.hardware import Hardware, detect
from rayline.models.registry import ModelVersion, read_samples
from rayline.ray_workloads.data.images import decode_image
from rayline.ray_workloads.execution.decoding import probe_photos
from rayline.ray_workloads.execution.fallback import PlanUse, demotion_reason
from rayline.ray_workloads.execution.interface import CONVERTERS, LoadedModel
from rayline.ray_workloads.execution.plan import PROBE_IMAGES, REFERENCE, PlanChoice, PlanPolicy, Probe
from rayline.specs import ImageSpec
from rayline.storage import conditional
from rayline.storage.layout import PLANS_DIR

logger = logging.getLogger(__name__)

# How long an actor waits for another's measurement (a ResNet-50's, OpenVINO conversion included, takes
# 10-30 s on 2 cores) before measuring itself; also the age at which a claim is taken over as abandoned.
MEASURE_WAIT_S = 300.0
CLAIM_POLL_S = 0.5


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


def plan_for(
    model: LoadedModel, version_uri: str, probe: Probe, policy: PlanPolicy, photos: Sequence[bytes | None] = ()
) -> PlanChoice:
    """Adopt this version's cached plan for this machine, or choose one on ``probe`` and cache it.

    ``photos``: a night's first photos as bytes. Where some can judge a decode and the plan has none judged
    (measured where the version was made, on decoded samples), the decode is judged on them and cached too;
    while another actor judges it, the plan runs with the unjudged decode, marked ``decode_pending``.
    """
    hardware = detect()
    if policy.mode == "off" or model.module is None:
        choice = model.choose_plan(probe, policy, hardware)
        logger.info("execution plan of %s: %s", model.spec.describe(), choice.reason)
        return choice
    judging = probe_photos(list(photos), model.image_spec) if model.image_spec else []
    versions = libraries()
    key = plan_key(hardware, policy, versions)
    uri, claimed_at = plan_uri(version_uri, key), claim_uri(version_uri, key)
    found, claim, pending = cached_plan(uri), None, False
    if not _complete(found, judging):
        claim = _claim(claimed_at)
        # another actor judges the cached plan's decode: rather than leave a core idle meanwhile, this one runs
        # the plan with the unjudged decode and looks again on its next chunk
        pending = claim is None and found is not None
        if claim is None and found is None:  # another actor measures: timing beside it would skew both
            found = _await_plan(uri, claimed_at, judging)
    try:
        if found is None:
            return _measure_and_store(model, version_uri, (key, uri), (probe, judging), policy, (hardware, versions))
        running = model.plan
        if (
            running is not None
            and running.decode_pending
            and (running.plan, running.artifact) == (found.plan, found.artifact)
        ):
            # looking again for the judged decode: the plan's model runs already (a session or a compile apiece)
            adopted = model.plan = replace(running, decode=found.decode, decode_pending=False)
        else:
            adopted = model.adopt(replace(found, key=key), _artifact_uri(version_uri, found))
        if pending:
            model.plan = replace(adopted, decode_pending=True)
            return model.plan
        if not _complete(found, judging):
            return _judge_decode_and_store(model, (version_uri, uri), judging, policy)
        logger.info("execution plan of %s (cached at %s): %s", model.spec.describe(), uri, adopted.reason)
        return adopted
    finally:
        if claim is not None:
            _release(claimed_at, claim)


def _complete(found: PlanChoice | None, judging: list[bytes]) -> bool:
    """A cached plan this actor can run as it is: one with its decode judged, or no photos to judge one on."""
    return found is not None and (found.decode is not None or not judging)


def _measure_and_store(
    model: LoadedModel,
    version_uri: str,
    where: tuple[str, str],
    probes: tuple[Probe, list[bytes]],
    policy: PlanPolicy,
    machine: tuple[Hardware, dict[str, str]],
) -> PlanChoice:
    """Measure the plan on the probe (decoded images, and photos to judge its decode) and cache it at ``where``
    (its key and URI), with its converted model."""
    (key, uri), (hardware, versions), (probe, photos) = where, machine, probes
    measured = model.plan = replace(model.choose_plan(probe, policy, hardware), key=key)
    if photos:
        measured = model.judge_decode(photos, policy)
    logger.info("execution plan of %s: %s", model.spec.describe(), measured.reason)
    if model.converted is not None and measured.plan.backend in CONVERTERS:
        measured = _store_converted(model, version_uri, key, measured)
        if measured.artifact is None:  # a plan whose model is not stored would fail every other actor: not cached
            return measured
    stored = store_plan(uri, measured, _extra(policy, versions))
    if stored is measured:
        return measured
    model.forget()  # another actor's plan: this one's probe scores may be of another decode
    return model.adopt(replace(stored, key=key), _artifact_uri(version_uri, stored))


def _judge_decode_and_store(
    model: LoadedModel, where: tuple[str, str], photos: list[bytes], policy: PlanPolicy
) -> PlanChoice:
    """Judge the adopted plan's decode on ``photos`` and add it to the cached record at ``where`` (the version's
    URI and the plan's), unless another actor added one first (then that plan runs)."""
    (version_uri, uri), judged = where, model.judge_decode(photos, policy)
    logger.info("execution plan of %s, its decode judged: %s", model.spec.describe(), judged.reason)
    try:
        found = conditional.read_versioned(uri)
        record = json.loads(found.data) if found else {}
        if found is None or PlanChoice.from_record(record).decode is None:
            data = json.dumps({**record, **judged.record()}, indent=2, sort_keys=True).encode()
            if found is None or conditional.replace_if_match(uri, data, found.token) is not None:
                return judged
    except (OSError, StorageError, ValueError) as exc:
        logger.warning("could not add the judged decode to the execution plan at %s (%s): uncached", uri, exc)
        return judged
    stored = cached_plan(uri)
    if stored is None or stored.decode is None:
        return judged
    model.forget()
    return model.adopt(replace(stored, key=judged.key), _artifact_uri(version_uri, stored))


def _extra(policy: PlanPolicy, versions: dict[str, str]) -> dict[str, Any]:
    return {"libraries": versions, "policy": policy.model_dump(mode="json")}


def demote(version_uri: str, key: str, reason: str) -> PlanChoice | None:
    """Replace the plan cached under ``key`` by fp32 eager, saying why and keeping the plan it replaced: every
    actor, night and replica of that version on that machine then runs the reference. None where nothing was
    replaced (no plan, the reference already, or a store that refused: logged)."""
    uri = plan_uri(version_uri, key)
    try:
        found = conditional.read_versioned(uri)
        if found is None:
            return None
        record = json.loads(found.data)
        current = PlanChoice.from_record(record)
        if current.plan == REFERENCE:
            return None
        demoted = PlanChoice(REFERENCE, current.hardware, reason, key=key)
        kept = {name: record[name] for name in ("libraries", "policy") if name in record}
        replaced = {"plan": current.plan.name, "reason": current.reason}
        data = json.dumps({**demoted.record(), **kept, "replaced": replaced}, indent=2, sort_keys=True).encode()
        if conditional.replace_if_match(uri, data, found.token) is None:
            return None  # replaced since it was read: by another night's demotion
    except (OSError, StorageError, ValueError) as exc:
        logger.warning("could not demote the execution plan at %s to fp32 eager (%s): %s", uri, exc, reason)
        return None
    logger.warning("execution plan at %s: %s", uri, reason)
    return demoted


def demote_overflowing(version_uri: str, uses: Mapping[tuple[str, str], PlanUse], night: str) -> dict[str, str]:
    """Demote each cached plan of ``version_uri`` that fell back to fp32 too often on ``night``
    (:meth:`PlanUse.demoted`); ``uses``: (plan name, cache key) -> its night. Plan name -> the reason cached."""
    demoted = {}
    for (name, key), use in sorted(uses.items()):
        if key and use.demoted():
            choice = demote(version_uri, key, demotion_reason(name, use, night))
            if choice is not None:
                demoted[name] = choice.reason
    return demoted


def claim_uri(version_uri: str, key: str) -> str:
    return storage.join(version_uri, PLANS_DIR, f"{key}.measuring")


def _claim_record(state: str) -> bytes:
    return json.dumps({"state": state, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}).encode()


def _claim(uri: str) -> str | None:
    """Claim the measurement: the claim's token, or None while another actor's live claim holds it.

    A claim released, or older than ``MEASURE_WAIT_S`` (its actor died), is taken over. A store that cannot
    coordinate counts as claimed: measuring is always safe, only slower.
    """
    try:
        created = conditional.create_exclusive(uri, _claim_record("measuring"))
        if created is not None:
            return created
        held = conditional.read_versioned(uri)
        if held is None:  # released and gone between the two calls: try once more
            return conditional.create_exclusive(uri, _claim_record("measuring"))
        record = json.loads(held.data)
        if record.get("state") == "measuring" and time.time() - float(record.get("at", 0)) < MEASURE_WAIT_S:
            return None
        return conditional.replace_if_match(uri, _claim_record("measuring"), held.token)
    except (OSError, StorageError, ValueError) as exc:
        logger.warning("could not claim the plan's measurement at %s (%s): measuring here", uri, exc)
        return "unclaimed"


def _release(uri: str, token: str) -> None:
    """Mark the claim released, so that actors still waiting (the plan was not cached) measure at once."""
    try:
        conditional.replace_if_match(uri, _claim_record("released"), token)
    except (OSError, StorageError) as exc:
        logger.warning("could not release the plan's measurement claim at %s (%s)", uri, exc)


def _await_plan(uri: str, claim: str, judging: list[bytes]) -> PlanChoice | None:
    """The plan another actor is measuring (with its decode judged, where ``judging`` could judge one), once
    stored; what is stored when its claim is released or outlives the wait."""
    deadline = time.monotonic() + MEASURE_WAIT_S
    logger.info("waiting for another actor's execution plan at %s", uri)
    while time.monotonic() < deadline:
        found = cached_plan(uri)
        if _complete(found, judging):
            return found
        try:
            held = conditional.read_versioned(claim)
            if held is None or json.loads(held.data).get("state") != "measuring":
                return cached_plan(uri)
        except (OSError, StorageError, ValueError):
            pass  # the plan file, not the claim, is what ends the wait
        time.sleep(CLAIM_POLL_S)
    logger.warning("no execution plan at %s after %.0f s: measuring here", uri, MEASURE_WAIT_S)
    return cached_plan(uri)


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


def probe_set(
    version: ModelVersion, image_spec: ImageSpec, first_images: np.ndarray | None = None
) -> np.ndarray | None:
    """The images a plan of ``version`` is judged on: its own sample images, and a night's first images.

    A version with neither (registered without ``--samples``, on a serving replica) is judged on views of
    scikit-learn's sample photos, logged: a blank or random probe's logits sit near a tie and say little.
    None without scikit-learn either: the caller runs fp32 eager.
    """
    parts = [p for p in (_version_samples(version), first_images) if p is not None and len(p)]
    if parts:
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])
    try:
        stand_ins: np.ndarray | None = _stand_in_photos(image_spec, PROBE_IMAGES)
        judged = ": its plan is judged on stand-in photos"
    except ConfigError:  # scikit-learn, whose photos they are, is not installed
        stand_ins, judged = None, " and scikit-learn is not installed for stand-ins: it runs fp32 eager"
    logger.warning("%s v%d has no sample images (register-model --samples)%s", version.name, version.version, judged)
    return stand_ins


def _version_samples(version: ModelVersion) -> np.ndarray | None:
    try:
        return read_samples(version)
    except (OSError, StorageError, ValueError) as exc:
        logger.warning("could not read the sample images of %s v%d (%s)", version.name, version.version, exc)
        return None


def _stand_in_photos(image_spec: ImageSpec, count: int) -> np.ndarray:
    from rayline.seed import photo_variant, source_photos

    photos, rng = source_photos(), np.random.default_rng(0)
    views = (photo_variant(photos[i % len(photos)], rng)[0] for i in range(count))
    return np.stack([decode_image(view, image_spec) for view in views])
