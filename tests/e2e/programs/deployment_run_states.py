"""The state of every flow run of one deployment.

``python -m tests.e2e.programs.deployment_run_states DEPLOYMENT``: prints one line of JSON, the state types
of the deployment's runs (``["COMPLETED"]``); runs without a state yet are left out.
"""

from __future__ import annotations

import asyncio
import json
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName


async def states(deployment: str) -> list[str]:
    async with get_client() as client:
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
        )
    return [r.state.type.value for r in runs if r.state]


def main(deployment: str) -> None:
    print(json.dumps(asyncio.run(states(deployment))))


if __name__ == "__main__":
    main(sys.argv[1])
