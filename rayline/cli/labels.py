"""``rayline labels``: people's labels for a model's predicted photos, imported into the ``labels`` table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from rayline.cli.common import DEFAULT_MODEL_NAME, ExitCode, JsonOption, echo_json, fail
from rayline.config import apply_process_defaults, get_settings
from rayline.errors import RaylineError

if TYPE_CHECKING:  # the flow and its stage load Prefect: only the command that runs them imports them
    from rayline.ray_workloads.quality.labels_import import LabelsImportResult

labels_app = typer.Typer(help="Labels: import people's answers for predicted photos.", no_args_is_help=True)


@labels_app.command("import")
def import_command(
    file: Annotated[str, typer.Argument(help="CSV, Parquet or JSON Lines (.csv, .parquet, .jsonl): path or URI.")],
    model: Annotated[str, typer.Option("--model", help="The registered model the labels are for.")] = (
        DEFAULT_MODEL_NAME
    ),
    key_base: Annotated[
        str | None, typer.Option(help="What a 'key' column is relative to; default <storage>/incoming.")
    ] = None,
    source: Annotated[str | None, typer.Option(help="Who labelled, for rows without a 'source' column.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Import a labels file: columns uri (or key) and label (a class name or index), optionally etag, source,
    labelled_at. Refused rows are counted by reason and listed in a CSV; importing a file again adds nothing.

    Exits 3 when any row was refused (the others are imported)."""
    apply_process_defaults()
    from rayline.flows.import_labels import import_labels

    try:
        get_settings()
        result = import_labels(file=file, model_name=model, key_base=key_base, source=source)
    except RaylineError as exc:
        fail(exc)
    if as_json:
        echo_json(result)
    else:
        _print_summary(result)
    if result.rejected:
        raise typer.Exit(code=ExitCode.REFUSED)


def _print_summary(result: LabelsImportResult) -> None:
    typer.echo("")
    typer.secho(f"labels import for {result.model_name} finished", bold=True)
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
