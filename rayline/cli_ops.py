"""Operations commands of the ``rayline`` CLI: the platform (up/down), serving, lineage."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rayline.cli_common import fail as _fail
from rayline.cli_common import quiet_ray as _quiet_ray
from rayline.config import apply_process_defaults, get_settings
from rayline.errors import RaylineError


def up() -> None:
    """Start a Prefect server, a Ray head and the deployments process on this machine (loopback)."""
    from rayline import platform

    try:
        settings = get_settings()
        ends, outcome = platform.up(settings)
    except RaylineError as exc:
        _fail(exc)
    for name, what in outcome.items():
        typer.echo(f"  {name:<12} {what}")
    typer.echo(f"Prefect UI       {ends.prefect_ui}")
    typer.echo(f"Ray dashboard    {ends.dashboard}")
    typer.echo(f"state and logs   {platform.state_dir(settings)}")
    typer.echo("Point rayline at it (e.g. before `rayline demo`):")
    typer.echo(f"  export PREFECT_API_URL={ends.prefect_api} RAY_ADDRESS={ends.ray_address} RAY_AUTH_MODE=token")


def down() -> None:
    """Stop exactly what `rayline up` started (by its PID files)."""
    from rayline import platform

    try:
        outcome = platform.down(get_settings())
    except RaylineError as exc:
        _fail(exc)
    if not outcome:
        typer.echo("nothing to stop: no PID files of `rayline up`")
    for name, what in outcome.items():
        typer.echo(f"  {name:<12} {what}")


serve_app = typer.Typer(help="Online serving: status and canary rollouts.", no_args_is_help=True)


@serve_app.command("status")
def serve_status() -> None:
    """Print live versions, traffic weights and per-version stats of the serving endpoint."""
    import httpx

    settings = get_settings()
    url = f"http://{settings.serve_host}:{settings.serve_port}"
    try:
        stats = httpx.get(f"{url}/stats", timeout=10).raise_for_status().json()
    except httpx.HTTPError as exc:
        _fail(RaylineError(f"no rayline serving endpoint answers at {url}: {exc}"))
    typer.echo(f"serving {stats.get('model') or 'nothing'} at {url}")
    _row("version", "weight", "requests", "errors", "p50 ms", "p95 ms", "p99 ms")
    weights: dict[str, float] = stats.get("weights", {})
    per_version: dict[str, dict[str, Any]] = stats.get("versions", {})
    for version in sorted(set(weights) | set(per_version), key=int):
        row = per_version.get(version, {})
        latencies = ["-" if row.get(k) is None else f"{row[k]:.1f}" for k in ("p50_ms", "p95_ms", "p99_ms")]
        _row(f"v{version}", f"{weights.get(version, 0):g}", row.get("requests", 0), row.get("errors", 0), *latencies)


def _row(*cells: object) -> None:
    typer.echo("  " + "  ".join(f"{c!s:>8}" for c in cells))


@serve_app.command("rollout")
def serve_rollout_command(
    candidate: Annotated[str, typer.Option(help="Alias or version to roll out.")] = "challenger",
    model_name: Annotated[str, typer.Option(help="Registry name.")] = "digits",
    soak_s: Annotated[float, typer.Option(min=0.1, help="Seconds each traffic step holds.")] = 10.0,
) -> None:
    """Run the serve-rollout flow: canary the candidate 10 → 50 → 100 %, promote or roll back."""
    apply_process_defaults()
    _quiet_ray()
    from flows.serve_rollout import serve_rollout

    try:
        get_settings()
        result = serve_rollout(candidate=candidate, model_name=model_name, soak_s=soak_s)
    except RaylineError as exc:
        _fail(exc)
    print_rollout_summary(result)


def print_rollout_summary(result: Any) -> None:
    typer.echo("")
    typer.secho("serve-rollout finished", bold=True)
    for step in result.steps:
        typer.echo(f"  {step.weight:>5g}%  {'passed' if step.passed else 'FAILED'}: {step.reason}")
    typer.echo(f"  {result.reason}")


def lineage_command(
    uri: Annotated[str, typer.Argument(help="Any stored output: a partition, model version, manifest or file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the graph as nested JSON, for machines.")] = False,
    max_objects: Annotated[
        int | None, typer.Option(min=0, help="Raw objects listed per ingest; default 20 in text, all in JSON.")
    ] = None,
) -> None:
    """Print where URI came from: stage runs, model version, training run, data, raw objects and their etags."""
    import json

    from rayline.lineage_graph import build_graph, render_text

    try:
        graph = build_graph(uri, max_objects=max_objects if max_objects is not None or as_json else 20)
    except RaylineError as exc:
        _fail(exc)
    typer.echo(json.dumps(graph.model_dump(mode="json"), indent=2) if as_json else render_text(graph))
