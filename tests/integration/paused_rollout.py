"""Rollouts in a process of their own, for drills that pause (SIGSTOP) or kill (SIGKILL) them.

``python -m tests.integration.paused_rollout '<PreparedRollout as JSON>' '<ServeConfig as JSON>' <ttl_s>``

Joins the cluster of ``RAY_ADDRESS``, takes the model's rollout lease (``ttl_s``,
renewed every ttl/3 from its own thread, as the serve-rollout flow holds it), proves
it held (``ensure_held``, as the flow does before every move), prints
``{"holding": <lease generation>}`` and waits for a line on stdin: the window between
the flow's check and its move, in which the test stops this process (SIGSTOP) past
the ttl. On the line it rolls back (``canary.roll_back``: the incumbent at 100 %, the
candidate's app deleted) carrying its lease's fencing token, and prints
``{"moved": true}`` or ``{"refused": "<why>"}``.

``python -m tests.integration.paused_rollout flow '<serve_rollout parameters as JSON>'``

Runs the whole serve-rollout flow (storage, Serve port and Prefect API from the
environment) with those parameters: the process a test kills mid-soak.
"""

from __future__ import annotations

import json
import sys

from rayline import ray_cluster
from rayline.errors import LeaseLost
from rayline.models import registry
from rayline.ray_workloads.serving import canary
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.storage import leases


def paused_move(argv: list[str]) -> None:
    prepared = canary.PreparedRollout.model_validate_json(argv[0])
    cfg = ServeConfig.model_validate_json(argv[1])
    ray_cluster.connect()
    model = prepared.candidate.name
    uri = registry.rollout_lease_uri(model)
    with leases.held(uri, leases.run_holder("paused rollout"), ttl_s=float(argv[2]), wait_s=30) as lease:
        lease.ensure_held()
        print(json.dumps({"holding": lease.fencing_token().generation}), flush=True)
        sys.stdin.readline()
        fenced = prepared.model_copy(update={"fence": lease.fencing_token()})
        try:
            canary.roll_back(fenced, [], "the paused rollout rolls back", cfg)
        except LeaseLost as exc:
            print(json.dumps({"refused": str(exc)}), flush=True)
            return
        print(json.dumps({"moved": True}), flush=True)


def whole_flow(parameters: str) -> None:
    from rayline.flows.serve_rollout import RolloutRequest, serve_rollout  # Prefect only for this mode

    serve_rollout(RolloutRequest.model_validate_json(parameters))


if __name__ == "__main__":
    if sys.argv[1] == "flow":
        whole_flow(sys.argv[2])
    else:
        paused_move(sys.argv[1:])
