"""A flow of your own around rayline's: predict a night with the champion, then report it your way.

This folder is a Prefect project with its own ``flows`` and ``tasks`` packages, as most have; rayline's
live under ``rayline.`` and do not collide with them. Run it from this folder with
``python -m flows.nightly_report 2026-11-28 [MODEL]`` (``RAYLINE_STORAGE`` names the storage root; the night's
photos are under ``<storage>/incoming/dt=<day>/``). ``tests/e2e/test_pages_as_written.py`` runs it as docs/api.md
says.
"""

from __future__ import annotations

import sys

from prefect import flow, get_run_logger
from tasks.counting import count_classes

from rayline import storage
from rayline.flows.nightly_inference import NightRequest, nightly_inference
from rayline.tables import read_night_pair
from rayline.tasks import openlineage_flow


@openlineage_flow  # a run of its own in OpenLineage: the parent its subflow's events name (docs/lineage.md)
@flow(name="nightly-report")
def nightly_report(day: str, model_name: str = "digits") -> dict[str, int]:
    """rayline's nightly-inference as a subflow, then the night's predicted classes counted by a task of ours."""
    nightly_inference(NightRequest(date=day, model_name=model_name))
    rows = read_night_pair(storage.storage_root(), model_name, day)
    get_run_logger().info("%s: %d predictions, %d errors", day, rows.predictions.num_rows, rows.errors.num_rows)
    counts = count_classes(rows.predictions.column("predicted_class").to_pylist())
    return {"predictions": rows.predictions.num_rows, "errors": rows.errors.num_rows, **counts}


if __name__ == "__main__":
    print(nightly_report(*sys.argv[1:3]))  # the day, and the model's name if not digits
