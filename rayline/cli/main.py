"""``rayline`` command line: seed sample data, run flows, register a model, vacuum the night tables, run the demo."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from rayline import storage
from rayline.cli import console, demo, labels, ops, platform, summaries
from rayline.cli.common import (
    ExitCode,
    JsonOption,
    before_flow,
    echo_json,
    exit_code,
    reports_errors,
    reserve_stdout_for_json,
)
from rayline.cli.request_options import request_options
from rayline.config import get_settings
from rayline.errors import NightsFailed, RaylineError
from rayline.ray_workloads.data.request import PrepareRequest
from rayline.ray_workloads.monitoring.request import MonitorRequest
from rayline.ray_workloads.nightly.request import NightRequest
from rayline.ray_workloads.registration.request import RegisterRequest
from rayline.ray_workloads.training.request import TrainRequest
from rayline.tables.prediction_reads import DEFAULT_RETENTION_HOURS, MIN_SAFE_RETENTION_HOURS

# Each command imports its flow when it runs: the flows load Prefect, Ray and torch (seconds),
# which `rayline --help` and the commands that start no flow do without.

app = typer.Typer(
    help="rayline: Prefect flows orchestrating Ray workloads for image classification.", no_args_is_help=True
)


# Commands that start no flow and no Ray work: their own output is all there is.
_PLAIN_COMMANDS = frozenset({"up", "down", "seed-data", "lineage"})


def _print_version(value: bool) -> None:
    if value:
        import rayline

        typer.echo(f"rayline {rayline.__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    ctx: typer.Context,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Print Ray worker logs, Ray Data stats and Prefect task lines here too, not only in the log file.",
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print rayline's version and exit."),
    ] = False,
) -> None:
    """Set the terminal up for the command: rayline's progress and summary; the rest in a log file."""
    command = ctx.invoked_subcommand
    # the command line's arguments: click hands the subcommand's to it only after this callback ran
    args = [*getattr(ctx, "_protected_args", []), *ctx.args, *sys.argv[1:]]
    # --json: stdout is the document alone, for another program to read
    if "--json" in args and "--help" not in args:
        reserve_stdout_for_json()
        return
    if command is None or command in _PLAIN_COMMANDS or "--help" in args:
        return
    terminal = console.open_terminal(command, _state_dir_or_none(), verbose)
    ctx.call_on_close(terminal.close)


def _state_dir_or_none() -> Path | None:
    try:
        return platform.state_dir(get_settings())
    except RaylineError:  # the command itself reports bad settings
        return None


@app.command("seed-data")
@reports_errors
def seed_data(
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="Target prefix: a local folder, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix.",
        ),
    ],
    corrupt: Annotated[int, typer.Option(min=0, help="Broken objects to add (several kinds).")] = 0,
    synthetic: Annotated[int, typer.Option(min=0, help="Generated images to add for scale tests.")] = 0,
    size: Annotated[int, typer.Option(min=8, max=1024, help="Side of the stored images in pixels.")] = 32,
    seed: Annotated[int, typer.Option(help="Random seed (output is deterministic).")] = 0,
    photos: Annotated[
        int,
        typer.Option(
            min=0,
            help="Photos to write instead of the digits: random views of scikit-learn's two real JPEG photos "
            "(crops, scales, flips, qualities, some over 2 megapixels) under <photo>/photo-<id>.jpg.",
        ),
    ] = 0,
    digits: Annotated[
        bool | None, typer.Option("--digits/--no-digits", help="Write the digits too (default: unless --photos).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Write scikit-learn's digits as PNG objects under <label>/<id>.png, or a day of photos (--photos N)."""
    from rayline.seed import seed as write_seed

    if digits is None:
        digits = photos == 0
    result = write_seed(to, corrupt=corrupt, synthetic=synthetic, size=size, seed=seed, photos=photos, digits=digits)
    if as_json:
        echo_json(result)
        return
    typer.echo(
        f"seeded {result.total} objects under {result.uri} "
        f"({result.digits} digits, {result.photos} photos, {len(result.corrupt)} corrupt, "
        f"{result.synthetic} synthetic; {result.written} written, {result.skipped} already present)"
    )


@app.command("prepare-data")
@reports_errors
@request_options(PrepareRequest, {"source_uri": "--source"}, hidden=frozenset({"image", "announce_retrain"}))
def prepare_data_command(request: PrepareRequest, as_json: JsonOption = False) -> None:
    """Run the prepare-data flow (ingest → preprocess) once."""
    before_flow()
    from rayline.flows.prepare_data import prepare_data

    result = prepare_data(request)
    echo_json(result) if as_json else summaries.print_prepare_summary(result)


@app.command("train-model")
@reports_errors
@request_options(TrainRequest, {"source_uri": "--source", "freeze_backbone": "--freeze-backbone/--train-backbone"})
def train_model_command(request: TrainRequest, as_json: JsonOption = False) -> None:
    """Run the train-model flow: prepare data, (tune,) train, evaluate, register, gate."""
    before_flow()
    from rayline.flows.train_model import train_model

    result = train_model(request)
    echo_json(result) if as_json else summaries.print_model_summary(result)


# the night's options are NightRequest's fields (a nested model's too), each named after its field but these
NIGHT_OPTIONS = {
    "date_from": "--from",
    "date_to": "--to",
    "input_uri": "--source",
    "max_concurrent_nights": "--max-concurrent",
    "mode": "--plan",
    "min_agreement": "--min-plan-agreement",
}


@app.command("nightly-inference")
@reports_errors
@request_options(NightRequest, NIGHT_OPTIONS)
def nightly_inference_command(request: NightRequest, as_json: JsonOption = False) -> None:
    """Run the nightly-inference flow once: predict a day of arrivals (or each night of --from..--to), commit it.

    A range prints one line per night and exits 1 if any night failed (the others are committed).
    """
    before_flow()
    from rayline.flows.nightly_inference import nightly_inference

    try:
        result = nightly_inference(request)
    except NightsFailed as exc:
        echo_json(exc.result) if as_json else summaries.print_backfill_summary(exc.result)
        raise typer.Exit(code=ExitCode.FAILED) from exc
    echo_json(result) if as_json else summaries.print_nightly_summary(result)


@app.command("monitor")
@reports_errors
@request_options(MonitorRequest, {"model_name": "--model"})
def monitor_command(request: MonitorRequest, as_json: JsonOption = False) -> None:
    """Run the monitor flow once: drift of a model's latest nights (and serving health), then vacuum."""
    before_flow(quiet=False)
    from rayline.flows.monitor import monitor

    result = monitor(request)
    echo_json(result) if as_json else summaries.print_monitor_summary(result)


@reports_errors
@request_options(RegisterRequest, {"weights_uri": "--weights", "draft": "--draft/--full-decode"})
def register_model_command(request: RegisterRequest, as_json: JsonOption = False) -> None:
    """Register a model you already have (see the README's "Bring your model"), as a new version."""
    before_flow(quiet=False)
    from rayline.flows.register_model import register_model

    result = register_model(request)
    echo_json(result) if as_json else summaries.print_registration(result)


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


app.command()(demo.demo)
app.command()(ops.up)
app.command()(ops.down)
app.command("lineage")(ops.lineage_command)
app.command("register-model")(register_model_command)
app.command("vacuum")(vacuum_command)
app.add_typer(ops.serve_app, name="serve")
app.add_typer(labels.labels_app, name="labels")


def main() -> None:
    try:
        app()
    except RaylineError as exc:  # pragma: no cover - typer handles most paths
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exit_code(exc))


if __name__ == "__main__":
    main()
