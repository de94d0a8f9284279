"""``rayline`` command line: seed sample data, run flows, run the demo."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from rayline import cli_ops, storage
from rayline.cli_common import fail as _fail
from rayline.cli_common import quiet_ray as _quiet_ray
from rayline.config import apply_process_defaults, get_settings
from rayline.errors import ConfigError, RaylineError

app = typer.Typer(
    help="rayline: Prefect flows orchestrating Ray workloads for image classification.", no_args_is_help=True
)


@app.command("seed-data")
def seed_data(
    to: Annotated[str, typer.Option("--to", help="Target prefix: a local folder or s3://bucket/prefix.")],
    corrupt: Annotated[int, typer.Option(min=0, help="Broken objects to add (several kinds).")] = 0,
    synthetic: Annotated[int, typer.Option(min=0, help="Generated images to add for scale tests.")] = 0,
    size: Annotated[int, typer.Option(min=8, max=1024, help="Side of the stored images in pixels.")] = 32,
    seed: Annotated[int, typer.Option(help="Random seed (output is deterministic).")] = 0,
) -> None:
    """Write scikit-learn's digits as PNG objects under raw/<label>/<id>.png."""
    from rayline.seed import seed as write_seed

    try:
        result = write_seed(to, corrupt=corrupt, synthetic=synthetic, size=size, seed=seed)
    except RaylineError as exc:
        _fail(exc)
    typer.echo(
        f"seeded {result.total} objects under {result.uri} "
        f"({result.digits} digits, {len(result.corrupt)} corrupt, {result.synthetic} synthetic; "
        f"{result.written} written, {result.skipped} already present)"
    )


@app.command("prepare-data")
def prepare_data_command(
    source: Annotated[str | None, typer.Option(help="Prefix to ingest; default <storage>/raw.")] = None,
    image_size: Annotated[int, typer.Option(min=4, max=1024)] = 32,
    force: Annotated[bool, typer.Option(help="Recompute even if the input is unchanged.")] = False,
) -> None:
    """Run the prepare-data flow (ingest → preprocess) once."""
    apply_process_defaults()
    _quiet_ray()
    from flows.prepare_data import prepare_data

    try:
        get_settings()  # fail fast, before Prefect and Ray start
        result = prepare_data(source_uri=source, image_size=image_size, force=force)
    except RaylineError as exc:
        _fail(exc)
    _print_prepare_summary(result)


def _print_prepare_summary(result: Any) -> None:
    ing, pre = result.ingest, result.preprocess
    typer.echo("")
    typer.secho("prepare-data finished", bold=True)
    typer.echo(f"  objects ingested   {ing.object_count} from {ing.source_uri}{' (reused)' if ing.cached else ''}")
    typer.echo(f"  content hash       {ing.content_hash}")
    typer.echo("  images per split   " + ", ".join(f"{k} {v}" for k, v in pre.counts.items()))
    typer.echo(f"  errors             {pre.error_count} {pre.error_types or ''}")
    typer.echo(f"  ingest manifest    {ing.manifest_uri}")
    typer.echo(f"  preprocessed       {pre.output_uri}")
    typer.echo(f"  summary            {pre.summary_uri}")
    typer.echo(f"  errors table       {pre.errors_uri}")


@app.command("train-model")
def train_model_command(
    source: Annotated[str | None, typer.Option(help="Prefix of labelled images; default <storage>/raw.")] = None,
    model_name: Annotated[str, typer.Option(help="Registry name.")] = "digits",
    arch: Annotated[str, typer.Option(help="small_cnn, resnet18, mobilenet_v3_small, …")] = "small_cnn",
    epochs: Annotated[int, typer.Option(min=1)] = 12,
    num_workers: Annotated[int, typer.Option(min=1, help="Ray Train workers.")] = 2,
    tune_samples: Annotated[int, typer.Option(min=0, help="ASHA trials first (0: no search).")] = 0,
    tune_max_epochs: Annotated[int, typer.Option(min=1)] = 4,
    margin: Annotated[float, typer.Option(help="Accuracy a candidate must gain over the champion.")] = 0.0,
    floor: Annotated[float, typer.Option(help="Accuracy the first champion needs.")] = 0.9,
    fail_once_at_epoch: Annotated[
        int | None, typer.Option(help="Fault drill: a worker raises once at this epoch, then training resumes.")
    ] = None,
    promote_to: Annotated[
        str, typer.Option(help="Alias a model that passes the gate gets: champion, or challenger for a rollout.")
    ] = "champion",
) -> None:
    """Run the train-model flow: prepare data, (tune,) train, evaluate, register, gate."""
    apply_process_defaults()
    _quiet_ray()
    from flows.train_model import train_model

    try:
        get_settings()
        if promote_to not in ("champion", "challenger"):
            raise ConfigError(f"--promote-to must be champion or challenger, got {promote_to!r}")
        result = train_model(  # type: ignore[call-overload]  # promote_to: a str the flow validates
            model_name=model_name,
            source_uri=source,
            arch=arch,
            epochs=epochs,
            num_workers=num_workers,
            tune_samples=tune_samples,
            tune_max_epochs=tune_max_epochs,
            margin=margin,
            floor=floor,
            fail_once_at_epoch=fail_once_at_epoch,
            promote_to=promote_to,
        )
    except RaylineError as exc:
        _fail(exc)
    _print_model_summary(result)


def _print_model_summary(result: Any) -> None:
    reg, trained = result.registration, result.trained
    typer.echo("")
    typer.secho("train-model finished", bold=True)
    if result.tuned is not None:
        best = result.tuned.best_config
        stopped = sum(t.epochs < max(x.epochs for x in result.tuned.trials) for t in result.tuned.trials)
        typer.echo(
            f"  tune (ASHA)        {len(result.tuned.trials)} trials, {stopped} stopped early; best lr {best.lr:.4g}, "
            f"batch {best.batch_size}, width {best.model.width}"
        )
    typer.echo(f"  trained            {trained.epochs} epochs with Ray Train, {trained.samples_per_s:.0f} samples/s")
    typer.echo(f"  test accuracy      {result.evaluation.accuracy:.4f} on {result.evaluation.samples} held-out images")
    typer.echo(f"  registered         {reg.version.name} v{reg.version.version}: {reg.decision.reason}")
    typer.echo(f"  alias              {reg.alias or 'none (gate not passed)'}")
    typer.echo(f"  champion then      v{reg.champion}" if reg.champion else "  champion then      none yet")
    typer.echo(f"  weights            {reg.version.weights_uri}")
    typer.echo(f"  evaluation         {result.evaluation.report_uri}")


@app.command("nightly-inference")
def nightly_inference_command(
    date: Annotated[str | None, typer.Option(help="Day to predict, YYYY-MM-DD; default yesterday (UTC).")] = None,
    model: Annotated[str, typer.Option(help="Registry alias (champion) or version (v3).")] = "champion",
    model_name: Annotated[str, typer.Option(help="Registry name.")] = "digits",
    source: Annotated[str | None, typer.Option(help="Input prefix; default <storage>/incoming/dt=<date>.")] = None,
    max_error_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="Error budget.")] = 0.05,
    actors: Annotated[int, typer.Option(min=1, help="Predictor actors.")] = 2,
    batch_size: Annotated[int, typer.Option(min=1, help="Images per model call.")] = 64,
) -> None:
    """Run the nightly-inference flow once: predict a day of arrivals and commit the partition."""
    apply_process_defaults()
    _quiet_ray()
    from flows.nightly_inference import nightly_inference

    try:
        get_settings()
        result = nightly_inference(
            date=date,
            model=model,
            model_name=model_name,
            input_uri=source,
            max_error_fraction=max_error_fraction,
            actors=actors,
            batch_size=batch_size,
        )
    except RaylineError as exc:
        _fail(exc)
    _print_inference_summary(result)


def _print_inference_summary(result: Any) -> None:
    typer.echo("")
    typer.secho("nightly-inference finished", bold=True)
    typer.echo(
        f"  {result.inputs} inputs → {result.predictions} predictions + {result.errors} errors "
        f"with {result.model} in {result.elapsed_s:.1f}s"
    )
    typer.echo(f"  committed          {result.manifest_uri}")


@app.command()
def demo(
    corrupt: Annotated[int, typer.Option(min=0, help="Broken objects mixed into the digits.")] = 4,
    tune_samples: Annotated[int, typer.Option(min=0, help="ASHA trials before training (0: no search).")] = 4,
    epochs: Annotated[int, typer.Option(min=1, help="Epochs of the tuned challenger's training run.")] = 12,
    baseline_epochs: Annotated[int, typer.Option(min=1, help="Epochs of the first, untuned champion.")] = 4,
    soak_s: Annotated[float, typer.Option(min=0.1, help="Seconds each rollout step holds.")] = 5.0,
) -> None:
    """The whole lifecycle on the digits: data, a first champion, a tuned challenger, serving with a
    canary rollout under load, and a night of batch inference."""
    apply_process_defaults()
    _quiet_ray()
    from flows.nightly_inference import INCOMING_DIR, nightly_inference, partition_for, yesterday_utc
    from flows.prepare_data import RAW_DIR
    from flows.train_model import train_model
    from rayline.lineage import lineage_dir
    from rayline.seed import seed as write_seed
    from rayline.seed import seed_incoming

    try:
        get_settings()  # fail fast, before Prefect and Ray start
        root = storage.storage_root()
        raw = storage.join(root, RAW_DIR)
        seeded = write_seed(raw, corrupt=corrupt)
        typer.echo(f"seeded {seeded.total} objects under {raw} ({seeded.written} new)")
        baseline = train_model(source_uri=raw, epochs=baseline_epochs, floor=0.8)
        typer.echo(f"baseline: {baseline.registration.decision.reason}")
        result = train_model(source_uri=raw, tune_samples=tune_samples, epochs=epochs, promote_to="challenger")
        rollout = _serve_and_roll_out(result, raw, soak_s)
        day = yesterday_utc()
        incoming = storage.join(root, INCOMING_DIR, partition_for(day))
        arrivals = seed_incoming(incoming, corrupt=corrupt)
        typer.echo(f"dropped {arrivals.total} arrivals under {incoming}")
        predictions = nightly_inference(date=day.isoformat())
    except RaylineError as exc:
        _fail(exc)
    _print_prepare_summary(result.data)
    _print_model_summary(result)
    if rollout is not None:
        cli_ops.print_rollout_summary(rollout)
    _print_inference_summary(predictions)
    typer.echo(f"  lineage records    {lineage_dir()}")
    api = os.environ.get("PREFECT_API_URL")
    typer.echo("")
    if api:
        typer.echo(f"Flow runs and artifacts: the Prefect UI of {api}")
    else:
        typer.echo("Flow runs and artifacts were recorded by Prefect's ephemeral API in ~/.prefect;")
        typer.echo("see them with `.venv/bin/prefect server start` and http://127.0.0.1:4200")


def _serve_and_roll_out(trained: Any, probe_uri: str, soak_s: float) -> Any:
    """Serve the champion, keep a small load on it, and canary the tuned challenger next to it."""
    import threading

    from flows.serve_rollout import serve_config, serve_rollout
    from ray_workloads import rollout
    from ray_workloads.images import ImageSpec
    from rayline import ray_cluster, registry
    from rayline.errors import RolloutRolledBack

    candidate = trained.registration
    if candidate.alias != registry.CHALLENGER:
        typer.echo(f"no rollout: v{candidate.version.version} did not pass the gate ({candidate.decision.reason})")
        return None
    ray_cluster.connect()
    cfg = serve_config()
    champion = registry.resolve(candidate.version.name, registry.CHAMPION)
    url = rollout.serve(champion, cfg)
    typer.echo(f"serving v{champion.version} at {url}; rolling out v{candidate.version.version} under load")
    images = rollout.load_probe_images(probe_uri, 32, ImageSpec.model_validate(champion.image_spec))
    load, stop = rollout.ProbeClient(url, images, rps=10.0), threading.Event()
    clients = threading.Thread(target=load.run_for, args=(3600.0, stop), daemon=True)
    clients.start()
    try:
        result = serve_rollout(candidate=registry.CHALLENGER, model_name=champion.name, soak_s=soak_s)
    except RolloutRolledBack as exc:
        typer.secho(f"rollout rolled back: {exc}", fg=typer.colors.YELLOW)
        result = None
    finally:
        stop.set()
        clients.join(timeout=60)
        load.close()
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(load.statuses.items()))
    typer.echo(
        f"load during the rollout: {load.sent} requests ({statuses}); connection errors: {load.connection_errors}"
    )
    for failure in load.first_failures:
        typer.secho(f"  failed request: {failure}", fg=typer.colors.YELLOW)
    return result


app.command()(cli_ops.up)
app.command()(cli_ops.down)
app.command("lineage")(cli_ops.lineage_command)
app.add_typer(cli_ops.serve_app, name="serve")


def main() -> None:
    try:
        app()
    except RaylineError as exc:  # pragma: no cover - typer handles most paths
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
