"""Model registry: immutable versions, movable aliases, a promotion gate.

Layout under ``<storage>/models/<name>/``::

    v<N>/weights.pt      state dict (tensors only)
    v<N>/samples.npy     a few of its own inputs, decoded as it decodes them: the
                         probe set its execution plans are judged on
    v<N>/predictions/    its answers on test splits, image by image, one file a split
                         (``rayline.models.split_answers``): its own, written before
                         version.json, and each candidate's split it was judged on
    v<N>/version.json    model spec, classes, metrics, data hash, code version,
                         producing run ids — written last: the version's commit
    aliases/<alias>.json the move that put the alias there ({"version": N,
                         "previous": M, ...}); moved by compare-and-swap
    rollout.lease        held while a rollout of the model runs, and for the
                         swap of a champion move outside one (``rayline.storage.leases``)

Version numbers are claimed with a create-if-absent write (``rayline.storage.conditional``: a hard link locally,
``If-None-Match: *`` on S3), so concurrent writers never get the same number. A claimed number without ``version.json``
is an unfinished registration and is never served. Alias moves are compare-and-swaps on the alias as read
(``rayline.models.aliases``): a move never overwrites one it did not see (``AliasConflict``), so its ``previous`` is
what it replaced.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import ExitStack
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import AliasConflict, ConfigError, InputDataError, LeaseBusy, LeaseLost, StorageError
from rayline.models import aliases, class_lists, split_answers
from rayline.models.aliases import AliasMove as AliasMove
from rayline.models.aliases import Unchecked as Unchecked
from rayline.models.promotion_gate import GateDecision as GateDecision
from rayline.models.promotion_gate import gate as gate
from rayline.models.refs import CHAMPION as CHAMPION
from rayline.models.refs import check_ref, split_ref
from rayline.models.refs import parse_named_ref as parse_named_ref
from rayline.specs import NAME_PATTERN, ImageSpec, ModelSpec, ParentModel, WeightsSource, check_model_name
from rayline.storage import conditional, leases
from rayline.storage.layout import (
    ALIASES_DIR,
    CLAIM_FILE,
    MODELS_DIR,
    ROLLOUT_LEASE,
    SAMPLES_FILE,
    VERSION_FILE,
    WEIGHTS_FILE,
)

MAX_SAMPLES = 32
# what a version stores, by the spec's format: a tensors-only state dict, or the user's code-free file as given
MODEL_FILES = {
    "state_dict": WEIGHTS_FILE,
    "torchscript": "model.torchscript.pt",
    "torch_export": "model.pt2",
    "onnx": "model.onnx",
}
CHALLENGER = "challenger"
# a champion move outside a rollout holds the rollout lease for one compare-and-swap
CHAMPION_MOVE_TTL_S = 60.0
_VERSION_DIR = re.compile(r"^v(\d+)$")


class TrainingLabels(BaseModel):
    """The people's labels a version was trained on: the labels imports its training photos were exported from
    (a photo it learned must never judge it: ``rayline.ray_workloads.quality.evidence``)."""

    labels_version: int | None = Field(description="The labels table version the training photos were exported at.")
    import_ids: list[str] = Field(description="The labels imports (files' SHA-256) that export held.")


class ModelVersion(BaseModel):
    """Everything needed to load, judge and trace one registered model."""

    name: str
    version: int
    uri: str
    weights_uri: str
    model_spec: ModelSpec
    image_spec: ImageSpec
    classes: list[str]
    metrics: dict[str, float]
    # trained here: the prepared data it learned from; an outside model has none (weights_source instead)
    data_manifest_uri: str | None = None
    data_content_hash: str | None = None
    code_version: str
    training_run_uri: str | None = None
    flow_run_id: str | None = None
    weights_source: WeightsSource | None = None
    parent: ParentModel | None = None
    trained_on_labels: TrainingLabels | None = None
    samples_uri: str | None = Field(
        None, description="Its sample images, decoded as it decodes its inputs: the probe set of its execution plans."
    )
    registered_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


def model_root(name: str) -> str:
    return storage.join(storage.storage_root(), MODELS_DIR, check_model_name(name))


def _claimed_versions(name: str) -> list[int]:
    fs, path = storage.filesystem(model_root(name))
    try:
        entries = fs.ls(path, detail=False) if fs.exists(path) else []
    except FileNotFoundError:
        entries = []
    matches = (_VERSION_DIR.match(str(entry).rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
    return sorted(int(match.group(1)) for match in matches if match)


def rollout_lease_uri(name: str) -> str:
    return storage.join(model_root(name), ROLLOUT_LEASE)


def rollout_lease_what(name: str) -> str:
    return f"the rollout of model {name}"


def _claim_next_version(name: str, idempotency_key: str | None = None) -> int:
    candidate = (max(_claimed_versions(name), default=0)) + 1
    # the claim names its writer: a retried S3 PUT recognises its own bytes by them
    claim_body = json.dumps(
        {"claimed_at": datetime.now(UTC).isoformat(), "writer": leases.run_holder(), "idempotency_key": idempotency_key}
    )
    for _ in range(1000):
        claim = storage.join(model_root(name), f"v{candidate}", CLAIM_FILE)
        if conditional.create_exclusive(claim, claim_body.encode()) is not None:  # None: another writer's
            return candidate
        candidate += 1
    raise StorageError(f"could not claim a version number for model {name}")


def _version_claimed_with(name: str, idempotency_key: str) -> int | None:
    """The version number a registration with this key claimed, newest first (a retry follows soon).

    A claim that cannot be read (throttled, a 5xx, denied) raises: it may be the first attempt's, and skipping
    it would register a second version.
    """
    for number in reversed(_claimed_versions(name)):
        claim = conditional.read_versioned(storage.join(model_root(name), f"v{number}", CLAIM_FILE))
        if claim is None:
            continue  # a version folder with no claim: nobody's registration
        try:
            recorded = json.loads(claim.data)
        except ValueError:
            continue  # a claim from before claims were JSON (a bare timestamp): it recorded no key
        if isinstance(recorded, dict) and recorded.get("idempotency_key") == idempotency_key:
            return number
    return None


def register(
    name: str,
    weights: bytes,
    *,
    model_spec: ModelSpec,
    image_spec: ImageSpec,
    classes: list[str],
    metrics: dict[str, float],
    code_version: str,
    data_manifest_uri: str | None = None,
    data_content_hash: str | None = None,
    training_run_uri: str | None = None,
    flow_run_id: str | None = None,
    weights_source: WeightsSource | None = None,
    parent: ParentModel | None = None,
    trained_on_labels: TrainingLabels | None = None,
    idempotency_key: str | None = None,
    samples: np.ndarray | None = None,
    answers: pa.Table | None = None,
) -> ModelVersion:
    """Store a new immutable version; ``version.json`` is written last.

    ``samples``: a few of its inputs as it decodes them (N×3×S×S float32, at most ``MAX_SAMPLES``), to judge
    execution plans on. ``answers``: its answers on its test split, image by image (``split_answers``), which
    a later candidate on the same images is paired with. ``idempotency_key``: a retry of the same
    registration gets the version its earlier attempt claimed (committed already, or finished now).
    """
    if samples is not None:  # refused before a version number is claimed
        _check_samples(samples, ImageSpec.model_validate(image_spec))
    class_lists.check_kept(name, classes, {v.version: v.classes for v in list_versions(name)})
    number, done = _claim(name, idempotency_key)
    if done is not None:
        return done
    uri = storage.join(model_root(name), f"v{number}")
    weights_uri, samples_uri = _store_files(uri, weights, ModelSpec.model_validate(model_spec), samples, answers)
    version = ModelVersion(
        name=name,
        version=number,
        uri=uri,
        weights_uri=weights_uri,
        model_spec=model_spec,
        image_spec=image_spec,
        classes=classes,
        metrics=metrics,
        data_manifest_uri=data_manifest_uri,
        data_content_hash=data_content_hash,
        code_version=code_version,
        training_run_uri=training_run_uri,
        flow_run_id=flow_run_id,
        weights_source=weights_source,
        parent=parent,
        trained_on_labels=trained_on_labels,
        samples_uri=samples_uri,
    )
    storage.write_json_atomic(storage.join(uri, VERSION_FILE), version.model_dump(mode="json"))
    return version


def _claim(name: str, idempotency_key: str | None) -> tuple[int, ModelVersion | None]:
    """The version number this registration writes, and that version when an earlier attempt finished it."""
    number = _version_claimed_with(name, idempotency_key) if idempotency_key else None
    if number is None:
        return _claim_next_version(name, idempotency_key), None
    return number, _read_version(name, number)


def _store_files(
    uri: str, weights: bytes, spec: ModelSpec, samples: np.ndarray | None, answers: pa.Table | None
) -> tuple[str, str | None]:
    """The version's files, all written before its ``version.json``: (weights URI, samples URI)."""
    weights_uri = storage.join(uri, MODEL_FILES[spec.format])
    storage.write_bytes_atomic(weights_uri, weights)
    if answers is not None:
        split_answers.store(uri, answers)
    return weights_uri, _store_samples(uri, samples) if samples is not None else None


def _check_samples(samples: np.ndarray, image: ImageSpec) -> None:
    expected = (3, image.size, image.size)
    if samples.ndim != 4 or samples.shape[1:] != expected or not 1 <= len(samples) <= MAX_SAMPLES:
        raise ConfigError(
            f"sample images must be 1 to {MAX_SAMPLES} decoded images of shape {expected}, got {samples.shape}"
        )


def _store_samples(version_uri: str, samples: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(samples, dtype=np.float32), allow_pickle=False)
    uri = storage.join(version_uri, SAMPLES_FILE)
    storage.write_bytes_atomic(uri, buffer.getvalue())
    return uri


def read_samples(version: ModelVersion) -> np.ndarray | None:
    """The version's sample images as it decodes them, or None when it was registered without any."""
    if version.samples_uri is None:
        return None
    samples: np.ndarray = np.load(io.BytesIO(storage.read_bytes(version.samples_uri)), allow_pickle=False)
    return samples


def _read_version(name: str, number: int) -> ModelVersion | None:
    """Version ``number`` of ``name``; None until its ``version.json``, the commit, is written."""
    uri = storage.join(model_root(name), f"v{number}", VERSION_FILE)
    return ModelVersion.model_validate(storage.read_json(uri)) if storage.exists(uri) else None


def get_version(name: str, version: int) -> ModelVersion:
    found = _read_version(name, version)
    if found is None:
        raise InputDataError(f"model {name} has no registered version {version}")
    return found


def version_at(version_uri: str) -> ModelVersion:
    """The version registered at ``version_uri`` (a version's folder, as a ``ParentModel`` names it)."""
    return ModelVersion.model_validate(storage.read_json(storage.join(version_uri, VERSION_FILE)))


def list_versions(name: str) -> list[ModelVersion]:
    """Committed versions, oldest first (claimed-but-unfinished ones are skipped)."""
    return [version for number in _claimed_versions(name) if (version := _read_version(name, number)) is not None]


def _alias_uri(name: str, alias: str) -> str:
    if not NAME_PATTERN.match(alias):
        raise ConfigError(f"alias {alias!r} must be lowercase letters, digits and '-'")
    return storage.join(model_root(name), ALIASES_DIR, f"{alias}.json")


def alias_version(name: str, alias: str) -> int | None:
    uri = _alias_uri(name, alias)
    return int(storage.read_json(uri)["version"]) if storage.exists(uri) else None


def alias_move(name: str, alias: str) -> AliasMove | None:
    """The move that put ``alias`` where it is now (None: no such alias)."""
    uri = _alias_uri(name, alias)
    return AliasMove.model_validate(storage.read_json(uri)) if storage.exists(uri) else None


def resolve(name: str, ref: str | int) -> ModelVersion:
    """A version from an alias (``champion``), ``v3``/``3``, or a number."""
    if isinstance(ref, int) or str(ref).lstrip("v").isdigit():
        return get_version(name, int(str(ref).lstrip("v")))
    number = alias_version(name, str(ref))
    if number is None:
        raise InputDataError(f"model {name} has no {ref!r} alias yet")
    return get_version(name, number)


def parse_ref(text: str, default_name: str, *, default_ref: str = CHAMPION) -> tuple[str, str]:
    """A model reference as the CLI takes it → (name, alias or version).

    ``NAME@champion`` / ``NAME@v3`` name both. A bare ``champion`` or ``v3`` refers to ``default_name``; a bare word
    that is no alias of ``default_name`` but a registered model's name means that model's ``default_ref``
    (``--model photos`` = ``photos@champion``).
    """
    name, ref = split_ref(text)
    if name is not None:
        return check_model_name(name), check_ref(ref or default_ref)
    token = check_ref(ref or default_ref)
    is_version = token.lstrip("v").isdigit()
    if not is_version and alias_version(default_name, token) is None and _claimed_versions(token):
        return token, default_ref
    return check_model_name(default_name), token


def set_alias(
    name: str,
    alias: str,
    version: int,
    reason: str,
    *,
    expected: int | None | Unchecked = Unchecked.ANY,
    rollout_holder: str | None = None,
    lease_wait_s: float = 0.0,
) -> AliasMove:
    """Point ``alias`` at ``version``: a compare-and-swap on the alias as read; returns the move for lineage.

    ``expected``: the version the caller decided against (None: against no alias); anything else there by now
    raises ``AliasConflict`` naming it. Without it the move still replaces only what it read, so ``previous``
    is exactly the version it replaced. An alias already on ``version`` is not moved again: the move that put
    it there stands (a retried task must not record a move from v3 to v3 in place of the one from v2 to v3).

    The champion is a rollout's to move while one runs: a rollout passes its lease's ``rollout_holder``
    (``LeaseLost`` unless it still holds it); any other champion move takes the model's rollout lease for the
    swap, waiting up to ``lease_wait_s`` for a running rollout, then ``AliasConflict``.
    """
    get_version(name, version)  # only committed versions can be aliased
    with ExitStack() as stack:
        if alias == CHAMPION and rollout_holder is not None:
            # a look, not a swap of the lease: its holder renews it from another thread. Should it expire
            # right after, a champion move taking it over still cannot overwrite this one (the alias's own swap)
            _check_rollout_holds(name, rollout_holder)
        elif alias == CHAMPION:
            holder = leases.run_holder(f"a champion move of {name}")
            lease = leases.held(
                rollout_lease_uri(name),
                holder,
                ttl_s=CHAMPION_MOVE_TTL_S,
                wait_s=lease_wait_s,
                describe=rollout_lease_what(name),
            )
            try:
                stack.enter_context(lease)
            except LeaseBusy as exc:
                raise AliasConflict(
                    f"champion of {name} not moved to v{version}: {exc}. The champion is that rollout's to move; "
                    "move it once the rollout ends, or make this version the challenger",
                    current=alias_version(name, CHAMPION),
                    rollout_holder=exc.holder,
                ) from exc
        return aliases.swap(_alias_uri(name, alias), name, alias, version, reason, expected)


def _check_rollout_holds(name: str, holder: str) -> None:
    """A rollout moves the champion only while it holds the model's rollout lease."""
    current = leases.read(rollout_lease_uri(name))
    live = current if current is not None and current.is_live() else None
    if live is not None and live.holder == holder:
        return
    now = "nobody holds it now" if live is None else f"now held by {live.holder} (expires in {live.expires_in():.0f} s)"
    raise LeaseLost(f"{holder} no longer holds {rollout_lease_what(name)} ({now}); it must not move the champion")
