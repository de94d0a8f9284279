"""Maintenance commands of the ``rayline`` CLI for the night tables: migrating legacy nights, vacuum."""

from __future__ import annotations

from typing import Annotated

import typer

from rayline import storage
from rayline.cli.common import fail
from rayline.config import get_settings
from rayline.errors import RaylineError
from rayline.lineage.nights import record_migrated_night
from rayline.tables.prediction_migration import Outcome, migrate_predictions
from rayline.tables.prediction_reads import DEFAULT_RETENTION_HOURS, MIN_SAFE_RETENTION_HOURS


def migrate_predictions_command(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would happen; change nothing.")] = False,
) -> None:
    """Move legacy night folders (predictions/<model>/dt=<day>/manifest.json) into the predictions tables.

    Each night's committed files are copied into its partition of prediction_errors, then predictions, as run
    migrated-<old run id>, and only then is the legacy folder removed; a rerun finds nothing left to do. A night
    the table already has from another run (a newer nightly run) is superseded: its legacy folder is removed, as
    the old layout's own rerun would have done. A night that fails keeps its folder and the command exits 1.
    """
    try:
        get_settings()
        results = migrate_predictions(storage.storage_root(), record=record_migrated_night, dry_run=dry_run)
    except RaylineError as exc:
        fail(exc)
    for result in results:
        typer.echo(f"{result.outcome:<14} {result.legacy.model_name} {result.legacy.dt}: {result.message}")
    counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "nothing to migrate"
    typer.echo(f"{len(results)} legacy night(s): {summary}" + (" (dry run: nothing changed)" if dry_run else ""))
    if counts[Outcome.FAILED]:
        raise typer.Exit(code=1)


def vacuum_command(
    retention_hours: Annotated[
        int,
        typer.Option(
            min=MIN_SAFE_RETENTION_HOURS,
            help="Keep every file a version current within this many hours needs (time travel that far back).",
        ),
    ] = DEFAULT_RETENTION_HOURS,
    apply: Annotated[bool, typer.Option("--apply", help="Delete the files; without it, only list them.")] = False,
) -> None:
    """List (or with --apply delete) the files of both predictions tables that no version within the retention needs:
    files replaced by reruns and files of runs that never committed. Refused while legacy night folders remain
    (run `rayline migrate-predictions` first)."""
    from rayline.tables.prediction_reads import vacuum_tables

    try:
        get_settings()
        removed = vacuum_tables(storage.storage_root(), retention_hours, dry_run=not apply)
    except RaylineError as exc:
        fail(exc)
    verb = "deleted" if apply else "would delete"
    if not removed:
        typer.echo("no predictions tables yet: nothing to vacuum")
    for table, files in removed.items():
        typer.echo(f"{table}: {verb} {len(files)} file(s) (retention {retention_hours} h)")
        for name in files:
            typer.echo(f"  {name}")
    if not apply and any(removed.values()):
        typer.echo("dry run: nothing deleted; --apply deletes them")
