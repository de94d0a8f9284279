"""``rayline labels``: people's labels for a model's predicted photos, imported into the ``labels`` table."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from rayline.cli import summaries
from rayline.cli.common import ExitCode, JsonOption, before_flow, echo_json, reports_errors
from rayline.cli.request_options import request_options
from rayline.ray_workloads.quality.requests import LabelQueueRequest, LabelsImportRequest

if TYPE_CHECKING:  # the flow and its stage load Prefect: only the command that runs them imports them
    from rayline.ray_workloads.quality.labels_import import LabelsImportResult


labels_app = typer.Typer(
    help="Labels: import people's answers for predicted photos; queue photos to label.", no_args_is_help=True
)


@labels_app.command("import")
@reports_errors
@request_options(LabelsImportRequest, {"model_name": "--model"}, arguments=frozenset({"file"}))
def import_command(request: LabelsImportRequest, as_json: JsonOption = False) -> None:
    """Import a labels file: columns uri (or key) and label (a class name or index), optionally etag, source,
    labelled_at. Refused rows are counted by reason and listed in a CSV; importing a file again adds nothing.

    Exits 3 when any row was refused (the others are imported)."""
    before_flow(quiet=False)
    from rayline.flows.import_labels import import_labels

    result = import_labels(request)
    echo_json(result) if as_json else _print_summary(result)
    if result.rejected:
        raise typer.Exit(code=ExitCode.REFUSED)


def _print_summary(result: LabelsImportResult) -> None:
    summaries.heading(f"labels import for {result.model_name} finished")
    typer.echo(f"  file               {result.file_uri} ({result.rows_read} rows)")
    if result.already_imported:
        typer.echo(f"  imported before    nothing added (labels table version {result.labels_version})")
        return
    typer.echo(f"  imported           {result.imported} labels (labels table version {result.labels_version})")
    typer.echo(f"  already labelled   {result.already_labelled}")
    for reason, count in result.rejected.items():
        typer.echo(f"  refused            {count} {reason}")
    if result.rejected_uri:
        typer.echo(f"  refused rows       {result.rejected_uri}")


@labels_app.command("queue")
@reports_errors
@request_options(LabelQueueRequest, {"model_name": "--model"})
def queue_command(request: LabelQueueRequest, as_json: JsonOption = False) -> None:
    """Queue the night's photos to label: a share drawn at random (the labels that judge a challenger), the rest
    those most worth labelling: unsure, disputed by its shadow version, or of classes predicted far more often
    than the reference (docs/quality.md). Writes a Label Studio task file and a CSV (fill its label column,
    then `rayline labels import` it); already-labelled photos are left out."""
    before_flow(quiet=False)
    from rayline.flows.queue_labels import queue_labels

    result = queue_labels(request)
    if as_json:
        echo_json(result)
        return
    summaries.heading(f"label queue for {result.model_name} {result.dt}")
    shadow = "with its shadow's disagreements" if result.shadowed else "no shadow version that night"
    typer.echo(f"  queued             {len(result.queued)} of {result.candidates} unlabelled photos ({shadow})")
    typer.echo(f"  drawn at random    {result.drawn} (label them all: they are what judges a challenger)")
    typer.echo(f"  already labelled   {result.already_labelled}")
    for q in result.queued[:5]:
        typer.echo(f"  {q.priority:.3f}  {q.uri}  {q.predicted_class}: {q.why()}")
    typer.echo(f"  Label Studio       {result.label_studio_uri}")
    typer.echo(f"  CSV                {result.csv_uri}")
