"""Cancel a training run mid-training and watch its Ray Train actors go.

``python -m tests.e2e.programs.cancel_training_run``: starts the train-model deployment for 200 epochs, waits
until Ray shows its ``RayTrainWorker``, sets the flow run Cancelling, and prints, a line each: ``training``
with the Train actors alive before the cancel, ``after cancel`` with those still alive after it (none, when
cancellation reaches Ray), and ``state`` with the run's final state type.
"""

from __future__ import annotations

import asyncio
import time
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.states import Cancelling
from ray.util.state import list_actors


def train_actors() -> list[str]:
    """The class names of Ray Train's live actors (its controller and workers)."""
    return [a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if "Train" in a.class_name]


async def cancel(run_id: UUID) -> None:
    async with get_client() as client:
        await client.set_flow_run_state(run_id, Cancelling(), force=True)


async def state(run_id: UUID) -> str:
    async with get_client() as client:
        run = await client.read_flow_run(run_id)
    assert run.state is not None, f"flow run {run_id} has no state"
    return run.state.type.value


def main() -> None:
    run = run_deployment("train-model/train-model", parameters={"request": {"epochs": 200}}, timeout=0)
    # called outside an event loop it returns the run; its annotation also allows an async caller's coroutine
    assert isinstance(run, FlowRun), run
    deadline = time.monotonic() + 240
    while "RayTrainWorker" not in train_actors() and time.monotonic() < deadline:
        time.sleep(1)
    print("training", sorted(set(train_actors())), flush=True)

    asyncio.run(cancel(run.id))
    deadline = time.monotonic() + 90
    while train_actors() and time.monotonic() < deadline:
        time.sleep(1)
    print("after cancel", sorted(set(train_actors())), flush=True)

    deadline = time.monotonic() + 60
    while (final := asyncio.run(state(run.id))) != "CANCELLED" and time.monotonic() < deadline:
        time.sleep(1)
    print("state", final)


if __name__ == "__main__":
    main()
