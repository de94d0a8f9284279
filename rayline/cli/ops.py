"""Operations commands of the ``rayline`` CLI: the platform (up/down), serving, lineage."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import SecretStr

from rayline.cli import platform, summaries
from rayline.cli.common import JsonOption, before_flow, echo_json, fail, reports_errors
from rayline.cli.platform_database import shown_databases
from rayline.cli.request_options import request_options
from rayline.config import get_settings
from rayline.errors import ConfigError, RaylineError
from rayline.ray_workloads.serving.request import RolloutRequest

if TYPE_CHECKING:  # for the type only: the flows load Prefect, Ray and torch, which `rayline --help` does without
    from rayline.flows.serve_rollout import RolloutResult


@reports_errors
def up(
    database_url: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL for the Prefect server and MLflow, postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE "
            "(RAYLINE_DATABASE_URL; a password here is in your shell's history: prefer the variable, PGPASSWORD "
            "or ~/.pgpass). Unset: SQLite in the state folder.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Start a Prefect server, a Ray head, and a work pool of every deployment with its worker (loopback)."""
    settings = get_settings()
    if database_url is not None:
        settings = settings.model_copy(update={"database_url": SecretStr(database_url)})
    ends, outcome = platform.up(settings)
    state = platform.state_dir(settings)
    databases = shown_databases(settings, state)
    if as_json:
        echo_json(
            {"services": outcome, "endpoints": dataclasses.asdict(ends), "state": str(state), "databases": databases}
        )
        return
    _print_services(outcome)
    typer.echo(f"Prefect UI       {ends.prefect_ui}")
    typer.echo(f"Ray dashboard    {ends.dashboard}")
    typer.echo(f"Ray metrics      {ends.ray_metrics}")
    typer.echo(f"MLflow UI        {ends.mlflow_ui}")
    typer.echo(f"Prefect database {databases['prefect']}")
    if "mlflow" in databases:
        typer.echo(f"MLflow database  {databases['mlflow']}")
    typer.echo(f"state and logs   {state}")
    typer.echo("Point rayline at it (e.g. before `rayline demo`):")
    typer.echo(
        f"  export PREFECT_API_URL={ends.prefect_api} RAY_ADDRESS={ends.ray_address} RAY_AUTH_MODE=token "
        f"MLFLOW_TRACKING_URI={ends.mlflow_ui}"
    )


@reports_errors
def down(as_json: JsonOption = False) -> None:
    """Stop exactly what `rayline up` started (by its PID files)."""
    outcome = platform.down(get_settings())
    if as_json:
        echo_json({"services": outcome})
        return
    if not outcome:
        typer.echo("nothing to stop: no PID files of `rayline up`")
    _print_services(outcome)


def _print_services(outcome: dict[str, str]) -> None:
    for name, what in outcome.items():
        typer.echo(f"  {name:<12} {what}")


serve_app = typer.Typer(
    help="Online serving: start/stop models behind the router, status, canary rollouts.", no_args_is_help=True
)


@serve_app.command(
    "start",
    help="Deploy a registered model version (--model NAME\\[@alias|vN]) behind the router: it takes all of its "
    "model's traffic when no other version of that model serves, else it waits at 0 % for `rayline serve rollout`. "
    "Runs on the cluster of RAY_ADDRESS (e.g. `rayline up`'s); without it on an embedded cluster, "
    "which dies with this command, so serving ends when it returns unless --block keeps it up.",
)
@reports_errors
def serve_start(
    model: Annotated[
        str, typer.Option(help="NAME, NAME@alias or NAME@vN (a bare name: its champion); any registered model.")
    ],
    block: Annotated[
        bool, typer.Option(help="Keep this process (and an embedded cluster) serving until Ctrl-C.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    before_flow()
    from rayline import ray_cluster
    from rayline.models import registry
    from rayline.ray_workloads.serving import control as serve_control
    from rayline.ray_workloads.serving import rollout
    from rayline.ray_workloads.serving.config import config_from_settings

    name, ref = registry.parse_named_ref(model)
    cfg = config_from_settings()
    version = registry.resolve(name, ref)
    connection = ray_cluster.connect()
    url = rollout.serve(version, cfg)
    weights = serve_control.get_weights(cfg, model=name)
    default = serve_control.routing_table(cfg).default_model
    share = weights.get(version.version, 0.0) / (sum(weights.values()) or 1.0)
    if as_json:
        served = {"model": name, "version": version.version, "ref": ref, "share": share, "url": url}
        echo_json({**served, "default_model": default, "embedded_cluster": connection.embedded})
    else:
        typer.echo(f"{name} v{version.version} ({ref}) deployed: {share:.0%} of {name}'s traffic")
        if share == 0:
            typer.echo(
                f"  another version serves {name}; move traffic with `rayline serve rollout --model-name {name}`"
            )
        also = f"  (and {url}/predict: the default model)" if default == name else ""
        typer.echo(f"  POST {url}/models/{name}/predict{also}")
    if connection.embedded and not as_json:
        typer.secho(
            "  note: this is an embedded Ray cluster; it stops when this command exits"
            + (" (Ctrl-C)" if block else " — set RAY_ADDRESS (e.g. `rayline up`) or use --block"),
            fg=typer.colors.YELLOW,
        )
    if block:
        _block_until_interrupted()


def _block_until_interrupted() -> None:
    import time

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        typer.echo("stopped")


@serve_app.command("stop")
@reports_errors
def serve_stop(
    model: Annotated[
        str | None, typer.Option(help="Model name to stop (all its versions); default: every model and the router.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Stop serving MODEL (the others keep answering), or without --model everything: models, router, control."""
    before_flow()
    from rayline import ray_cluster
    from rayline.models import registry
    from rayline.ray_workloads.serving import control as serve_control
    from rayline.ray_workloads.serving.config import config_from_settings

    name = registry.parse_named_ref(model)[0] if model is not None else None
    if model is not None and "@" in model:
        raise ConfigError(f"--model takes a model name, not a version ({model!r}): stop removes every version")
    cfg = config_from_settings()
    ray_cluster.connect()
    if name is None:
        serve_control.shutdown(cfg)
        if as_json:
            echo_json({"stopped": "everything", "still_served": []})
        else:
            typer.echo("stopped every model, the router and the control actor")
        return
    apps = serve_control.remove_model(name, cfg)
    rest = serve_control.routing_table(cfg)
    if as_json:
        echo_json({"stopped": name, "applications": apps, "still_served": list(rest.models)})
        return
    typer.echo(f"stopped {name} ({', '.join(apps)}); still served: {', '.join(rest.models) or 'nothing'}")


@serve_app.command("status")
def serve_status(as_json: JsonOption = False) -> None:
    """Print every served model: live versions, traffic weights and per-version stats."""
    import httpx

    settings = get_settings()
    url = f"http://{settings.serve_host}:{settings.serve_port}"
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            served = client.get("/models").raise_for_status().json()
            per_model = {m: client.get(f"/models/{m}/stats").raise_for_status().json() for m in served["models"]}
    except httpx.HTTPError as exc:
        fail(RaylineError(f"no rayline serving endpoint answers at {url}: {exc}"))
    if as_json:
        echo_json({"url": url, "default_model": served.get("default"), "models": per_model})
        return
    if not per_model:
        typer.echo(f"serving nothing at {url}")
    for name, stats in per_model.items():
        default = " (default: POST /predict)" if name == served.get("default") else ""
        typer.echo(f"serving {name} at {url}/models/{name}/predict{default}")
        _row("version", "weight", "requests", "errors", "p50 ms", "p95 ms", "p99 ms")
        weights: dict[str, float] = stats.get("weights", {})
        per_version: dict[str, dict[str, Any]] = stats.get("versions", {})
        for version in sorted(set(weights) | set(per_version), key=int):
            row = per_version.get(version, {})
            latencies = ["-" if row.get(k) is None else f"{row[k]:.1f}" for k in ("p50_ms", "p95_ms", "p99_ms")]
            cells = (f"{weights.get(version, 0):g}", row.get("requests", 0), row.get("errors", 0), *latencies)
            _row(f"v{version}", *cells)


def _row(*cells: object) -> None:
    typer.echo("  " + "  ".join(f"{c!s:>8}" for c in cells))


@serve_app.command("rollout")
@reports_errors
@request_options(RolloutRequest, {"steps": "--step"})
def serve_rollout_command(request: RolloutRequest, as_json: JsonOption = False) -> None:
    """Run the serve-rollout flow: canary the candidate 10 → 50 → 100 %, promote or roll back."""
    before_flow()
    from rayline.flows.serve_rollout import serve_rollout

    result = serve_rollout(request)
    echo_json(result) if as_json else print_rollout_summary(result)


def print_rollout_summary(result: RolloutResult) -> None:
    summaries.heading("serve-rollout finished")
    if result.reconciled is not None:  # what a rollout that did not finish left, before this one's steps
        typer.echo(f"  first: {result.reconciled}")
    for step in result.steps:
        typer.echo(f"  {step.weight:>5g}%  {'passed' if step.passed else 'FAILED'}: {step.reason}")
    typer.echo(f"  {result.reason}")


@reports_errors
def lineage_command(
    uri: Annotated[
        str,
        typer.Argument(
            help="Any stored output: a night table with --dt, a night's partition folder, a model version, "
            "a manifest or a file."
        ),
    ],
    dt: Annotated[
        str | None,
        typer.Option("--dt", help="With a night table (<storage>/predictions): the night of this day, YYYY-MM-DD."),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="With --dt: that model's night only (default: every model's).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the graph as nested JSON, for machines.")] = False,
    max_objects: Annotated[
        int | None, typer.Option(min=0, help="Raw objects listed per ingest; default 20 in text, all in JSON.")
    ] = None,
) -> None:
    """Print where URI came from: stage runs, model version, training run, data, raw objects and their etags.

    A night resolves to the Delta version that committed it and the run: `rayline lineage <storage>/predictions
    --dt 2026-11-28 [--model digits]`, or its partition folder `<storage>/predictions/model_name=digits/dt=2026-11-28`.
    """
    from rayline.lineage.graph import build_graph, render_text

    if model is not None and dt is None:
        raise ConfigError(f"--model {model} picks a night: give --dt too")
    listed = max_objects if max_objects is not None or as_json else 20
    graph = build_graph(uri, max_objects=listed, dt=dt, model_name=model)
    echo_json(graph) if as_json else typer.echo(render_text(graph))
