"""How many flow runs completed, and the name of the newest: the run the UI test looks for on the runs page.

``python -m tests.e2e.programs.newest_completed_run``: prints ``COUNT NAME`` (the name empty when none).
"""

from __future__ import annotations

import asyncio

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort


async def completed_runs() -> list[FlowRun]:
    """Completed flow runs, newest start first."""
    async with get_client() as client:
        done = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED])))
        return await client.read_flow_runs(flow_run_filter=done, sort=FlowRunSort.START_TIME_DESC)


def main() -> None:
    runs = asyncio.run(completed_runs())
    print(len(runs), runs[0].name if runs else "")


if __name__ == "__main__":
    main()
