"""Which of Ray's essential lines reached Prefect's task logs: Ray Data's stats, Tune's trials, an epoch.

``python -m tests.e2e.programs.ray_lines_in_prefect_logs``: pages through every log of the API and prints one
line of JSON, the sorted markers that begin a message logged by a task run.
"""

from __future__ import annotations

import asyncio
import json

from prefect.client.orchestration import get_client

MARKERS = ["Ray Data execution stats:", "Ray Tune trials (best first):", "epoch 11: train loss"]


async def found() -> list[str]:
    seen: set[str] = set()
    offset = 0
    async with get_client() as client:
        while page := await client.read_logs(limit=200, offset=offset):
            seen |= {m for m in MARKERS for log in page if log.message.startswith(m) and log.task_run_id}
            offset += len(page)
    return sorted(seen)


def main() -> None:
    print(json.dumps(asyncio.run(found())))


if __name__ == "__main__":
    main()
