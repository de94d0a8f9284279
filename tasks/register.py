"""Prefect task: register a trained model and run the promotion gate."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from ray_workloads import evaluate, preprocess
from ray_workloads.models import ModelSpec, state_dict_from_bytes
from ray_workloads.train import TrainResult
from rayline import events, lineage, mlflow_mirror, ray_cluster, registry, storage
from rayline.errors import ConfigError
from rayline.lineage import DatasetRef
from rayline.specs import ParentModel
from tasks.common import emit, idempotency_key, ray_task, record_lineage, run_context

GATE_METRIC = "test_accuracy"


class RegistrationResult(BaseModel):
    version: registry.ModelVersion
    decision: registry.GateDecision
    champion: int | None
    alias: str | None = None  # the alias the candidate got, if it passed the gate


def _champion_score(name: str, candidate: registry.ModelVersion) -> tuple[registry.ModelVersion | None, float | None]:
    """The champion's score on the candidate's test split (re-evaluated if it was trained on other data)."""
    number = registry.alias_version(name, registry.CHAMPION)
    if number is not None and number == candidate.version:
        # a retried attempt: the first one already promoted it; judge it against the version it replaced
        move = registry.alias_move(name, registry.CHAMPION)
        number = move.previous if move is not None else None
    if number is None:
        return None, None
    champion = registry.get_version(name, number)
    if champion.data_content_hash == candidate.data_content_hash and GATE_METRIC in champion.metrics:
        return champion, champion.metrics[GATE_METRIC]
    if candidate.data_manifest_uri is None:
        raise ConfigError(f"{name} v{candidate.version} has no test split to judge it on")
    return champion, evaluate.run(champion.model_spec, champion.weights_uri, candidate.data_manifest_uri).accuracy


def _check_same_classes(name: str, classes: list[str]) -> None:
    """A candidate is judged against its champion on one test split: both must predict the same classes."""
    number = registry.alias_version(name, registry.CHAMPION)
    if number is None:
        return
    champion = registry.get_version(name, number)
    if champion.classes != classes:
        shown = ", ".join(champion.classes[:5]) + (", …" if len(champion.classes) > 5 else "")
        raise ConfigError(
            f"{name}'s champion v{number} predicts {len(champion.classes)} classes ({shown}); this model predicts "
            f"{len(classes)} ({', '.join(classes[:5])}{', …' if len(classes) > 5 else ''}). "
            "Register it under another name (--model-name)."
        )


@ray_task("register-and-gate")
def register_and_gate(
    name: str,
    spec: ModelSpec,
    trained: TrainResult,
    evaluation: evaluate.EvaluationResult,
    margin: float = 0.0,
    floor: float = 0.9,
    promote_to: str = registry.CHAMPION,
    parent: ParentModel | None = None,
) -> RegistrationResult:
    """Register the trained weights and gate them.

    A candidate that passes becomes ``promote_to``: ``champion`` directly, or
    ``challenger`` when serving decides (a canary rollout moves the champion
    later). The first model that passes the floor is champion either way.
    ``parent``: the version a fine-tune started from (kept on the version and
    named among the lineage record's inputs).
    """
    if promote_to not in (registry.CHAMPION, registry.CHALLENGER):
        raise ConfigError(f"promote_to must be champion or challenger, got {promote_to!r}")
    started = datetime.now(UTC)
    connection = ray_cluster.connect()
    prepared = preprocess.read_manifest(evaluation.data_manifest_uri)
    weights = storage.read_bytes(trained.weights_uri)
    state_dict_from_bytes(weights, trained.weights_uri)  # refuse anything but tensors before registering
    _check_same_classes(name, prepared.classes)
    record_context = run_context(connection)
    key = idempotency_key(name, trained.weights_uri, evaluation.data_manifest_uri)
    version = registry.register(
        name,
        weights,
        model_spec=spec.model_copy(update={"num_classes": len(prepared.classes)}),
        image_spec=prepared.image,
        classes=prepared.classes,
        metrics={GATE_METRIC: evaluation.accuracy, **{f"best_{k}": v for k, v in trained.metrics.items()}},
        data_manifest_uri=evaluation.data_manifest_uri,
        data_content_hash=prepared.input_content_hash,
        code_version=lineage.code_version(),
        training_run_uri=trained.run_uri,
        flow_run_id=record_context.flow_run_id,
        parent=parent,
        idempotency_key=key,
    )
    champion, champion_score = _champion_score(name, version)
    decision = registry.gate(
        version,
        champion,
        metric=GATE_METRIC,
        candidate_score=evaluation.accuracy,
        champion_score=champion_score,
        margin=margin,
        floor=floor,
    )
    moves = []
    alias = None
    if decision.promoted:
        alias = registry.CHAMPION if champion is None or promote_to == registry.CHAMPION else registry.CHALLENGER
        moves.append(registry.set_alias(name, alias, version.version, decision.reason))
    if alias == registry.CHALLENGER:  # serving canaries it: the serve-rollout deployment listens
        emit(
            events.CHALLENGER_REGISTERED,
            events.model_resource(name, version.version),
            payload={"model": name, "version": version.version, "reason": decision.reason},
            labels={"rayline.model": name},
            idempotency_key=key,
        )
    get_run_logger().info("registered %s v%d; gate: %s", name, version.version, decision.reason)
    mlflow_mirror.reconcile(name)  # best effort: a failure is logged, and the next registration catches up
    create_markdown_artifact(
        key="model-gate",
        markdown=(
            f"### {name} v{version.version}: {f'passed, now {alias}' if alias else 'not promoted'}\n\n"
            f"{decision.reason}\n\nweights `{version.weights_uri}`"
        ),
    )
    record_lineage(
        stage="registry",
        started_at=started,
        inputs=[
            DatasetRef(uri=trained.checkpoint_uri),
            DatasetRef(uri=evaluation.data_manifest_uri),
            *([DatasetRef(uri=parent.uri, facets={"parent": parent.model_dump()})] if parent else []),
        ],
        outputs=[
            DatasetRef(
                uri=version.uri,
                content_hash=prepared.input_content_hash,
                facets={"moves": [m.model_dump(mode="json") for m in moves], "gate": decision.model_dump()},
            )
        ],
        parameters={"name": name, "margin": margin, "floor": floor, "metric": GATE_METRIC},
        connection=connection,
    )
    return RegistrationResult(
        version=version, decision=decision, champion=registry.alias_version(name, registry.CHAMPION), alias=alias
    )
