"""Labelled arrivals announced as ingest announces them, and the retraining runs they start.

``python -m tests.e2e.programs.burst_of_arrivals PREFIX``: one arrival below the retraining threshold, then
a burst of five above it. Prints ``below N``, the retrain runs after the first, and ``burst [source_uri, ...]``,
the runs after the burst, once a second run would have had time to appear.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.events import emit_event


def arrival(prefix: str, eligible: str) -> None:
    emit_event(
        event="rayline.data.arrived",
        payload={"source_uri": prefix, "new_labelled": 500},
        resource={"prefect.resource.id": f"rayline.data.{prefix}", "rayline.retrain": eligible},
    )


async def retrain_runs() -> list[Any]:
    """The ``source_uri`` of every run of the retrain deployment: a field of its one ``request`` parameter."""
    async with get_client() as client:
        found = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["retrain"]))
        )
    return [r.parameters.get("request", {}).get("source_uri") for r in found]


def main(prefix: str) -> None:
    arrival(prefix + "-small", "false")  # below the threshold: no run
    time.sleep(3)
    print("below", len(asyncio.run(retrain_runs())))
    for _ in range(5):  # a burst above it: one run
        arrival(prefix, "true")
    deadline = time.monotonic() + 60
    while not asyncio.run(retrain_runs()) and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(5)  # would a second run appear?
    print("burst", asyncio.run(retrain_runs()))


if __name__ == "__main__":
    main(sys.argv[1])
