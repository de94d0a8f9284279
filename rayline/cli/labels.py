"""``rayline labels``: people's labels for a model's predicted photos, imported into the ``labels`` table."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from rayline.cli import summaries
from rayline.cli.common import ExitCode, JsonOption, before_flow, echo_json, reports_errors
from rayline.ray_workloads.nightly.request import DEFAULT_MODEL_NAME

if TYPE_CHECKING:  # the flow and its stage load Prefect: only the command that runs them imports them
    from rayline.ray_workloads.quality.labels_import import LabelsImportResult


class Selection(StrEnum):
    random = "random"


labels_app = typer.Typer(
    help="Labels: import people's answers for predicted photos; queue photos to label.", no_args_is_help=True
)


@labels_app.command("import")
@reports_errors
def import_command(
    file: Annotated[str, typer.Argument(help="CSV, Parquet or JSON Lines (.csv, .parquet, .jsonl): path or URI.")],
    model: Annotated[str, typer.Option(help="The registered model the labels are for.")] = DEFAULT_MODEL_NAME,
    key_base: Annotated[
        str | None, typer.Option(help="What a 'key' column is relative to; default <storage>/incoming.")
    ] = None,
    source: Annotated[str | None, typer.Option(help="Who labelled, for rows without a 'source' column.")] = None,
    selection: Annotated[
        Selection | None,
        typer.Option(
            help="random: the file's photos were chosen uniformly at random, whatever the models answered, so its "
            "labels may judge a challenger (a queue's random draw needs no saying; docs/quality.md)."
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Import a labels file: columns uri (or key) and label (a class name or index), optionally etag, source,
    labelled_at. Refused rows are counted by reason and listed in a CSV; importing a file again adds nothing.

    Exits 3 when any row was refused (the others are imported)."""
    before_flow(quiet=False)
    from rayline.flows.import_labels import import_labels

    result = import_labels(
        file=file, model_name=model, key_base=key_base, source=source, selection=selection.value if selection else None
    )
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
def queue_command(
    night: Annotated[str, typer.Option("--night", help="The night to choose from, YYYY-MM-DD.")],
    budget: Annotated[int, typer.Option(min=1, help="Photos to queue, at most.")] = 100,
    model: Annotated[str, typer.Option(help="The registered model whose night it is.")] = DEFAULT_MODEL_NAME,
    random_share: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Share of the budget drawn at random from the night: the only labels that may judge a challenger.",
        ),
    ] = 0.2,
    as_json: JsonOption = False,
) -> None:
    """Queue the night's photos to label: a share drawn at random (the labels that judge a challenger), the rest
    those most worth labelling: unsure, disputed by its shadow version, or of classes predicted far more often
    than the reference (docs/quality.md). Writes a Label Studio task file and a CSV (fill its label column,
    then `rayline labels import` it); already-labelled photos are left out."""
    before_flow(quiet=False)
    from rayline.flows.queue_labels import queue_labels

    result = queue_labels(night=night, budget=budget, model_name=model, random_share=random_share)
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
