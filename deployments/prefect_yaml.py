"""``prefect.yaml`` from the deployment table, for teams that deploy with ``prefect deploy`` to a work pool.

The table in ``catalog.py`` is the one source; a test keeps the committed file equal to this rendering.
The work pool comes from ``RAYLINE_WORK_POOL`` at deploy time (a ``process`` pool on a VM, or a
``kubernetes`` pool running the image of ``deployments/cluster/Dockerfile``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # no stubs installed; only safe_dump is used

from rayline.deployments.catalog import DeploymentSpec, deployment_table

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Generated from deployments/catalog.py by `python -m rayline.deployments.prefect_yaml > prefect.yaml`.\n"


def _entrypoint(spec: DeploymentSpec) -> str:
    source = Path(inspect.getfile(spec.flow.fn)).resolve().relative_to(ROOT)
    return f"{source.as_posix()}:{spec.flow.fn.__name__}"


def _schedules(spec: DeploymentSpec) -> list[dict[str, Any]]:
    if spec.cron:
        return [{"cron": spec.cron, "timezone": spec.timezone}]
    if spec.interval:
        return [{"interval": int(spec.interval.total_seconds()), "timezone": spec.timezone}]
    return []


def _trigger(trigger: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "event",
        "name": trigger.name,
        "enabled": True,
        "expect": sorted(trigger.expect),
        "match": trigger.match.model_dump(),
        "posture": trigger.posture.value,
        "threshold": trigger.threshold,
        "within": int(trigger.within.total_seconds()),
    }
    if trigger.for_each:
        out["for_each"] = sorted(trigger.for_each)
    if trigger.parameters:
        out["parameters"] = trigger.parameters
    return out


def render_dict() -> dict[str, Any]:
    return {
        "name": "rayline",
        "prefect-version": "3.9.1",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $RAYLINE_HOME }}"}}],
        "deployments": [
            {
                "name": spec.name,
                "description": spec.description,
                "entrypoint": _entrypoint(spec),
                "parameters": spec.parameters,
                "schedules": _schedules(spec),
                "triggers": [_trigger(t) for t in spec.triggers],
                "work_pool": {"name": "{{ $RAYLINE_WORK_POOL }}", "job_variables": {}},
            }
            for spec in deployment_table()
        ],
    }


def render() -> str:
    return HEADER + str(yaml.safe_dump(render_dict(), sort_keys=False, allow_unicode=True, width=100))


if __name__ == "__main__":  # pragma: no cover
    print(render(), end="")
