"""Maintenance commands of the ``rayline`` CLI for the night tables: vacuum."""

from __future__ import annotations

from typing import Annotated

import typer

from rayline import storage
from rayline.cli.common import JsonOption, echo_json, reports_errors
from rayline.config import get_settings
from rayline.tables.prediction_reads import DEFAULT_RETENTION_HOURS, MIN_SAFE_RETENTION_HOURS


@reports_errors
def vacuum_command(
    retention_hours: Annotated[
        int,
        typer.Option(
            min=MIN_SAFE_RETENTION_HOURS,
            help="Keep every file a version current within this many hours needs (time travel that far back).",
        ),
    ] = DEFAULT_RETENTION_HOURS,
    apply: Annotated[bool, typer.Option("--apply", help="Delete the files; without it, only list them.")] = False,
    as_json: JsonOption = False,
) -> None:
    """List (or with --apply delete) the files of both predictions tables that no version within the retention needs:
    files replaced by reruns and files of runs that never committed."""
    from rayline.tables.prediction_reads import vacuum_tables

    get_settings()
    removed = vacuum_tables(storage.storage_root(), retention_hours, dry_run=not apply)
    if as_json:
        echo_json({"dry_run": not apply, "retention_hours": retention_hours, "files": removed})
        return
    verb = "deleted" if apply else "would delete"
    if not removed:
        typer.echo("no predictions tables yet: nothing to vacuum")
    for table, files in removed.items():
        typer.echo(f"{table}: {verb} {len(files)} file(s) (retention {retention_hours} h)")
        for name in files:
            typer.echo(f"  {name}")
    if not apply and any(removed.values()):
        typer.echo("dry run: nothing deleted; --apply deletes them")
