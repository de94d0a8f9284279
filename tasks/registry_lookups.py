"""Prefect tasks: the model registry lookups flows make, and the MLflow mirror they keep in line.

Flows reach the registry only through these, so a throttled lookup is retried like any stage; a missing
alias or a malformed reference fails at once with its own message.
"""

from __future__ import annotations

from rayline.models import registry
from rayline.models.mlflow_mirror import MirrorReport
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.registration import mlflow_models
from rayline.specs import DEFAULT_MODEL_NAME
from rayline.tasks.common import DEFAULT_TIMEOUT_S, io_task


@io_task("parse-model-ref")
def parse_model_ref_task(text: str, default_name: str) -> tuple[str, str]:
    """``registry.parse_ref``: (name, alias or version); a task, as a bare word is looked up in the registry."""
    return registry.parse_ref(text, default_name)


@io_task("resolve-model-version")
def resolve_version_task(name: str, ref: str | int) -> ModelVersion:
    """The committed version ``ref`` (an alias, ``v3``, or a number) names."""
    return registry.resolve(name, ref)


def requested_version(ref: str, model_name: str | None) -> ModelVersion:
    """The version a request's ``ref`` names: of ``model_name``, else of the model a bare word names (``photos``
    is photos@champion), else of the default model (``v3``)."""
    if model_name is not None:
        return resolve_version_task(model_name, ref)
    return resolve_version_task(*parse_model_ref_task(ref, DEFAULT_MODEL_NAME))


@io_task("read-model-alias")
def alias_version_task(name: str, alias: str) -> int | None:
    """The version ``alias`` points at now; None while there is no such alias."""
    return registry.alias_version(name, alias)


# Mirroring uploads each version's weights to MLflow: minutes for a large model, never hours.
@io_task("mirror-model-registry", timeout_s=DEFAULT_TIMEOUT_S)
def reconcile_mirror_task(name: str) -> MirrorReport | None:
    """Complete MLflow's mirror of ``name`` (what an earlier run left unfinished); never raises
    (``rayline.ray_workloads.registration.mlflow_models``): None when tracking is off or the mirror failed."""
    return mlflow_models.reconcile(name)
