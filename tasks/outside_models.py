"""Prefect task: register an outside model (a user's weights file) as a new version."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from rayline import lineage, ray_cluster
from rayline.ray_workloads.registration import mlflow_models, outside_models
from rayline.ray_workloads.registration.outside_models import RegisterModelConfig, RegisterModelResult
from rayline.ray_workloads.registration.request import RegisterRequest
from rayline.tasks.common import emit_alias_move, ray_task, record_lineage, run_context


@ray_task("register-model", timeout_s=900, connects=False)
def register_outside_model(request: RegisterRequest) -> RegisterModelResult:
    """Check and store the model as this flow run's; the version's lineage input is the file and its hash.
    Only a factory needs the cluster (its import is checked on every node): only then does it connect to Ray."""
    if request.factory is not None:
        ray_cluster.connect()
    run = {"code_version": lineage.code_version(), "flow_run_id": run_context().flow_run_id}
    cfg = RegisterModelConfig.model_validate({**request.model_dump(), **run})  # this run's marks over any given
    result = outside_models.run(cfg)
    version, move, source = result.version, result.alias_move, result.weights_source
    if move is not None:  # a challenger is canaried: serve-rollout listens
        emit_alias_move(move)
    mlflow_models.reconcile(version.name)  # best effort: logged on failure, completed by the next call
    what = "already registered as" if result.reused else "registered as"
    get_run_logger().info("%s %s %s v%d", source.uri, what, version.name, version.version)
    if result.note:
        get_run_logger().info(result.note)
    create_markdown_artifact(
        key="model-registration",
        markdown=(
            f"### {version.name} v{version.version}{f', now {move.alias}' if move else ''}\n\n"
            f"`{version.model_spec.describe()}`, {len(version.classes)} classes, {version.image_spec.describe()}\n\n"
            f"weights from `{source.uri}` (sha256 `{source.sha256[:16]}…`), stored at `{version.weights_uri}`"
        ),
    )
    record_lineage("registry", result, parameters=cfg.model_dump(exclude={"code_version", "flow_run_id"}))
    return result
