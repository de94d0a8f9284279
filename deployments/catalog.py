"""Every deployment, from one small table (deployments as code).

``build_deployments()`` turns the table into Prefect ``RunnerDeployment``s;
a long-running process serves them with ``prefect.serve(*build_deployments())``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    flow: Flow[..., Any]
    cron: str | None = None
    timezone: str = "UTC"
    parameters: dict[str, Any] = field(default_factory=dict)
    description: str = ""


def deployment_table() -> list[DeploymentSpec]:
    from flows.nightly_inference import nightly_inference
    from flows.prepare_data import prepare_data
    from flows.train_model import train_model

    return [
        DeploymentSpec(
            name="nightly-inference",
            flow=nightly_inference,
            cron="0 2 * * *",
            description="Yesterday's arrivals (UTC) through the champion, committed to predictions/dt=…",
        ),
        DeploymentSpec(name="prepare-data", flow=prepare_data, description="Ingest and preprocess raw/ on demand"),
        DeploymentSpec(name="train-model", flow=train_model, description="Tune, train, evaluate, register, gate"),
    ]


def build_deployments() -> list[RunnerDeployment]:
    return [
        spec.flow.to_deployment(  # type: ignore[misc]  # sync call returns the deployment itself
            name=spec.name,
            schedule=Cron(spec.cron, timezone=spec.timezone) if spec.cron else None,
            parameters=spec.parameters,
            description=spec.description,
        )
        for spec in deployment_table()
    ]
