"""rayline's lineage as the tools around it read it: the OpenLineage events of the file transport, and Prefect's asset
events from the API's event store (``POST /events/filter``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from rayline import storage
from tests.unit.test_openlineage import validate

MATERIALIZED = "prefect.asset.materialization.succeeded"
ENDED = ("COMPLETE", "FAIL", "ABORT")


def stored_events(root: str) -> list[dict[str, Any]]:
    """Every OpenLineage event the file transport wrote under ``root``, oldest first, each validated against the
    client's own event model."""
    events = [storage.read_json(o.uri) for o in storage.list_objects(storage.join(root, "lineage", "openlineage"))]
    for event in events:
        validate(event)
    return sorted(events, key=lambda e: str(e["eventTime"]))


def assert_drawable(events: list[dict[str, Any]], flows: Iterable[str], stood_in: Iterable[str] = ()) -> None:
    """What a consumer needs to draw the runs: each of ``flows`` ran as a run of its own (START, then an end),
    every run named as a parent has events of its own, and every dataset a run wrote (``stood_in`` jobs aside: a
    test's hand-written records) carries its schema and ``outputStatistics``."""
    by_job = {(e["job"]["name"], e["eventType"]) for e in events}
    for flow in flows:
        assert (flow, "START") in by_job and any((flow, end) in by_job for end in ENDED), (flow, sorted(by_job))
    started = {e["run"]["runId"] for e in events if e["eventType"] == "START"}
    parents = {e["run"]["facets"]["parent"]["run"]["runId"]: e for e in events if "parent" in e["run"]["facets"]}
    missing = {run: e["run"]["facets"]["parent"]["job"]["name"] for run, e in parents.items() if run not in started}
    assert not missing, f"parent runs without events of their own: {missing}"
    skipped = set(stood_in)
    for event in events:
        if event["eventType"] == "COMPLETE" and event["job"]["name"] not in skipped:
            for output in event["outputs"]:
                assert output["facets"]["schema"]["fields"], (event["job"]["name"], output["name"])
                assert "outputStatistics" in output["outputFacets"], (event["job"]["name"], output["name"])


def materializations(api_url: str, auth: tuple[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every successful asset materialization the API holds, by asset key, oldest first."""
    query = {"filter": {"event": {"name": [MATERIALIZED]}, "order": "ASC"}, "limit": 50}
    found: dict[str, list[dict[str, Any]]] = {}
    with httpx.Client(auth=auth, timeout=30) as client:
        page = client.post(f"{api_url}/events/filter", json=query).raise_for_status().json()
        while True:
            for event in page["events"]:
                found.setdefault(event["resource"]["prefect.resource.id"], []).append(event)
            if not page.get("next_page"):
                return found
            page = client.get(page["next_page"]).raise_for_status().json()


def wait_for_materializations(
    api_url: str,
    done: Callable[[dict[str, list[dict[str, Any]]]], bool],
    auth: tuple[str, str] | None = None,
    timeout_s: float = 30.0,
) -> dict[str, list[dict[str, Any]]]:
    """:func:`materializations` once ``done`` says they are all there: the client sends events in the background
    and the server stores them in batches."""
    deadline = time.monotonic() + timeout_s
    while not done(found := materializations(api_url, auth)):
        assert time.monotonic() < deadline, f"asset events still missing after {timeout_s:.0f} s: {sorted(found)}"
        time.sleep(0.5)
    return found
