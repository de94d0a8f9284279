"""Every deployment, from one small table (deployments as code).

``prefect.yaml`` renders the table for ``prefect deploy`` into a work pool (what ``rayline up`` does);
``build_deployments()`` turns it into ``RunnerDeployment``s for ``prefect.serve`` in one process.

The lifecycle runs itself: nights on a cron, data hourly, a ``retrain`` on new labelled data, labels or
drift (debounced by ``RETRAIN_DEBOUNCE``, per model), a rollout of each new challenger, and the monitor
every 15 minutes. Each spec's description says what it does; the plan decides a retrain's search or
fine-tune (``rayline.ray_workloads.training.plan.plan_training``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.events.schemas.automations import Posture
from prefect.schedules import Cron, Interval, Schedule

from rayline import events
from rayline.config import deployment_request
from rayline.ray_workloads.data.request import PrepareRequest
from rayline.ray_workloads.monitoring.request import MonitorRequest
from rayline.ray_workloads.serving.request import RolloutRequest
from rayline.ray_workloads.training.request import TrainRequest
from rayline.tables.prediction_reads import DEFAULT_RETENTION_HOURS

RETRAIN_DEBOUNCE = timedelta(minutes=30)


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    flow: Flow[..., Any]
    cron: str | None = None
    interval: timedelta | None = None
    timezone: str = "UTC"
    parameters: dict[str, Any] = field(default_factory=dict)
    triggers: list[Any] = field(default_factory=list)  # Prefect's trigger union
    description: str = ""

    def schedule(self) -> Schedule | None:
        if self.cron:
            return Cron(self.cron, timezone=self.timezone)
        if self.interval:
            return Interval(self.interval, timezone=self.timezone)
        return None


def _on(
    event: str,
    name: str,
    within: timedelta,
    match: dict[str, str] | None = None,
    for_each: set[str] | None = None,
    **parameters: Any,
) -> Any:
    """A reactive trigger: fires on the first matching event, then ignores matches for ``within``;
    ``for_each``: resource labels that split the debounce (a burst from one model swallows no other's)."""
    return DeploymentEventTrigger(
        name=name,
        expect={event},
        match=match or {},
        for_each=for_each or set(),
        posture=Posture.Reactive,
        threshold=1,
        within=within,
        parameters=parameters or None,
    )


def _retrain(**fields: Any) -> dict[str, Any]:
    """The retrain deployment's request: 4 ASHA trials first, a winner made challenger, and ``fields`` (event
    templates). A trigger's parameters replace the deployment's whole request: each trigger carries all of it."""
    retrain = TrainRequest(tune_samples=4, promote_to="challenger")
    return {"request": {**retrain.model_dump(exclude_unset=True), **fields}}


def deployment_table() -> list[DeploymentSpec]:
    from rayline.flows.monitor import monitor
    from rayline.flows.nightly_inference import NightRequest, nightly_inference
    from rayline.flows.prepare_data import prepare_data
    from rayline.flows.serve_rollout import serve_rollout
    from rayline.flows.train_model import train_model

    return [
        DeploymentSpec(
            name="nightly-inference",
            flow=nightly_inference,
            cron="0 2 * * *",
            # the schedule's request names no night (yesterday's); a manual run given a range is a backfill
            parameters={"request": deployment_request("nightly-inference", NightRequest)},
            description=(
                "Yesterday's arrivals (UTC) through the champion, committed as its night (model_name, dt) "
                "of the predictions tables; a request's date_from/date_to (and max_concurrent_nights) run a "
                "range of nights: a backfill"
            ),
        ),
        DeploymentSpec(
            name="prepare-data",
            flow=prepare_data,
            interval=timedelta(hours=1),
            parameters={"request": deployment_request("prepare-data", PrepareRequest)},
            description="Ingest and preprocess raw/; announces new objects (rayline.data.arrived)",
        ),
        DeploymentSpec(name="train-model", flow=train_model, description="Tune, train, evaluate, register, gate"),
        _retrain_deployment(train_model),
        DeploymentSpec(
            name="serve-rollout",
            flow=serve_rollout,
            parameters={"request": deployment_request("serve-rollout", RolloutRequest)},
            triggers=[
                _on(
                    events.ALIAS_MOVED,
                    "roll-out-new-challenger",
                    timedelta(0),
                    match={"rayline.alias": "challenger"},
                    # a trigger's parameters replace the deployment's: the whole request, the event's version in it
                    request={
                        **deployment_request("serve-rollout", RolloutRequest),
                        "candidate": "v{{ event.payload.version }}",
                        "model_name": "{{ event.payload.model }}",
                    },
                )
            ],
            description="Canary a challenger 10 → 50 → 100 %, promote or roll back",
        ),
        DeploymentSpec(
            name="monitor",
            flow=monitor,
            interval=timedelta(minutes=15),
            parameters={"request": deployment_request("monitor", MonitorRequest)},
            description=(
                "Serving health and prediction drift; emits rayline.drift.detected; vacuums the predictions tables "
                f"({DEFAULT_RETENTION_HOURS} h retention: time travel reaches that far)"
            ),
        ),
    ]


def _retrain_deployment(train_model: Flow[..., Any]) -> DeploymentSpec:
    """Train on labelled data, fine-tune the champion on enough new labels, or retrain a model that drifted."""
    model = "{{ event.payload.model }}"
    retrain_label = {events.RETRAIN_LABEL: "true"}
    triggers = [
        _on(
            events.DATA_ARRIVED,
            "retrain-on-labelled-data",
            RETRAIN_DEBOUNCE,
            retrain_label,
            **_retrain(source_uri="{{ event.payload.source_uri }}"),
        ),
        _on(
            events.LABELS_ARRIVED,
            "retrain-on-new-labels",
            RETRAIN_DEBOUNCE,
            retrain_label,
            for_each={"rayline.model"},
            **_retrain(model_name=model, labelled=True),
        ),
        _on(
            events.DRIFT_DETECTED,
            "retrain-on-drift",
            RETRAIN_DEBOUNCE,
            for_each={"rayline.model"},
            **_retrain(model_name=model),
        ),
    ]
    return DeploymentSpec(
        name="retrain",
        flow=train_model,
        parameters=_retrain(),
        triggers=triggers,
        description=(
            "Retrain when labelled data arrives or drift is detected (4 ASHA trials first; a fine-tuned "
            "model is fine-tuned again from its parent, no search), or fine-tune the champion on its labelled "
            "photos when enough labels came back; a winner becomes challenger"
        ),
    )


def build_deployments() -> list[RunnerDeployment]:
    return [
        spec.flow.to_deployment(  # type: ignore[misc]  # sync call returns the deployment itself
            name=spec.name,
            schedule=spec.schedule(),
            parameters=spec.parameters,
            triggers=spec.triggers or None,
            description=spec.description,
        )
        for spec in deployment_table()
    ]
