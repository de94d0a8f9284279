"""The summaries the CLI prints when a flow finishes: what a user reads to know what happened."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from rayline.ray_workloads.nightly.request import BackfillResult, NightOutcome
from rayline.skipped import skipped_text

if TYPE_CHECKING:  # for the types only: importing the flows at run time loads Prefect, Ray and torch
    from rayline.flows.monitor import MonitorResult
    from rayline.flows.prepare_data import PrepareDataResult
    from rayline.flows.train_model import TrainModelResult
    from rayline.ray_workloads.nightly.batch_inference import InferenceResult, NightSkipped
    from rayline.ray_workloads.registration.outside_models import RegisterModelResult


def heading(title: str) -> None:
    typer.echo("")
    typer.secho(title, bold=True)


def print_prepare_summary(result: PrepareDataResult) -> None:
    ing, pre = result.ingest, result.preprocess
    heading("prepare-data finished")
    typer.echo(f"  objects ingested   {ing.object_count} from {ing.source_uri}{' (reused)' if ing.cached else ''}")
    if ing.skipped:
        typer.echo(f"  skipped            {skipped_text(ing.skipped)}")
    typer.echo(f"  content hash       {ing.content_hash}")
    typer.echo("  images per split   " + ", ".join(f"{k} {v}" for k, v in pre.counts.items()))
    typer.echo(f"  errors             {pre.error_count} {pre.error_types or ''}")
    typer.echo(f"  ingest manifest    {ing.manifest_uri}")
    typer.echo(f"  preprocessed       {pre.output_uri}")
    typer.echo(f"  summary            {pre.summary_uri}")
    typer.echo(f"  errors table       {pre.errors_uri}")


def print_model_summary(result: TrainModelResult) -> None:
    reg, trained = result.registration, result.trained
    heading("train-model finished")
    if result.tuned is not None:
        best = result.tuned.best_config
        stopped = sum(t.epochs < max(x.epochs for x in result.tuned.trials) for t in result.tuned.trials)
        typer.echo(
            f"  tune (ASHA)        {len(result.tuned.trials)} trials, {stopped} stopped early; best lr {best.lr:.4g}, "
            f"batch {best.batch_size}, width {best.model.width}"
        )
    parent = reg.version.parent
    if parent is not None:
        how = "head only" if parent.freeze_backbone else "whole network"
        typer.echo(
            f"  fine-tuned from    {parent.name} v{parent.version} ({how}), a new head for {reg.version.classes}"
        )
    typer.echo(f"  trained            {trained.epochs} epochs with Ray Train, {trained.samples_per_s:.0f} samples/s")
    typer.echo(f"  test accuracy      {result.evaluation.accuracy:.4f} on {result.evaluation.samples} held-out images")
    typer.echo(f"  registered         {reg.version.name} v{reg.version.version}: {reg.decision.reason}")
    typer.echo(f"  alias              {reg.alias or 'none (gate not passed)'}")
    typer.echo(f"  champion then      v{reg.champion}" if reg.champion else "  champion then      none yet")
    typer.echo(f"  weights            {reg.version.weights_uri}")
    typer.echo(f"  evaluation         {result.evaluation.report_uri}")


def print_registration(result: RegisterModelResult) -> None:
    version = result.version
    source = version.weights_source
    assert source is not None  # register-model always records where the user's weights came from
    heading("register-model finished")
    state = "already registered as" if result.reused else "registered as"
    typer.echo(
        f"  {state:<18} {version.name} v{version.version} ({version.model_spec.arch}, {len(version.classes)} classes)"
    )
    typer.echo(f"  preprocessing      {version.image_spec.describe()}")
    typer.echo(f"  weights from       {source.uri} (sha256 {source.sha256[:16]}…)")
    typer.echo(f"  stored at          {version.weights_uri}")
    if result.alias_move is not None:
        typer.echo(f"  alias              {result.alias_move.alias} → v{version.version}")
    if result.note:
        typer.echo(f"  note               {result.note}")


def print_inference_summary(result: InferenceResult | NightSkipped) -> None:
    from rayline.ray_workloads.execution.plan import plans_text
    from rayline.ray_workloads.nightly.batch_inference import NightSkipped  # loaded already: the result came from it

    heading("nightly-inference finished")
    if isinstance(result, NightSkipped):  # another run committed the night
        typer.echo(f"  night              {result.night}: not committed by this run")
        typer.echo(f"  why                {result.message}")
        return
    typer.echo(
        f"  {result.inputs} inputs → {result.predictions} predictions + {result.errors} errors "
        f"with {result.model} in {result.elapsed_s:.1f}s"
    )
    if result.skipped:
        typer.echo(f"  skipped            {skipped_text(result.skipped)}")
    typer.echo(f"  execution plan     {plans_text(result.plans)}")
    typer.echo(f"  CPU                {result.cost_text()}")
    if result.reused_blocks:
        reused = f"{result.reused_blocks} of {result.blocks}"
        typer.echo(f"  resumed            {reused} blocks of an earlier attempt reused")
    typer.echo(f"  night              {result.night}")
    typer.echo(f"  predictions        {result.predictions_table} (Delta version {result.predictions_version})")
    typer.echo(f"  errors             {result.errors_table} (Delta version {result.errors_version})")
    if result.shadow is not None:
        typer.echo(f"  shadow             {result.shadow.line()}")


def print_nightly_summary(result: InferenceResult | NightSkipped | BackfillResult) -> None:
    """What a nightly-inference run did: its one night, or each night of its range."""
    if isinstance(result, BackfillResult):
        print_backfill_summary(result)
    else:
        print_inference_summary(result)


def backfill_night_line(night: NightOutcome) -> str:
    """One night of a range: day, state, counts, Delta versions or why it failed."""
    state = "FAILED" if night.state == "failed" else night.state
    line = f"  {night.dt}  {state:<9}"
    if night.inputs is not None:
        line += f"  {night.inputs} inputs → {night.predictions} predictions + {night.errors} errors"
        if night.skipped_objects:
            line += f"; skipped {skipped_text(night.skipped_objects)}"
        line += f"  (Delta versions: predictions {night.predictions_version}, errors {night.errors_version})"
    return f"{line}  {night.message}".rstrip()


def print_backfill_summary(result: BackfillResult) -> None:
    counts = ", ".join(f"{len(result.in_state(s))} {s}" for s in ("committed", "skipped", "failed"))
    heading(
        f"nightly-inference finished: {result.model}, {result.date_from} to {result.date_to} "
        f"({len(result.nights)} nights, {result.max_concurrent_nights} at a time): {counts}"
    )
    for night in result.nights:
        failed = night.state == "failed"
        typer.secho(backfill_night_line(night), fg=typer.colors.RED if failed else None)


def print_monitor_summary(result: MonitorResult) -> None:
    heading("monitor finished")
    for night in result.partitions:
        verdict = "DRIFT: " + "; ".join(night.reasons) if night.drifted else "ok"
        typer.echo(
            f"  {night.partition}  predicted by {night.model_name} {night.model}  (predictions table version "
            f"{night.version})  PSI {night.psi:.3f} vs {night.reference}  {verdict}"
        )
    for q in result.quality:
        typer.echo(
            f"  dt={q.dt}  labelled: {q.model_name} v{q.model_version} ({q.role}) right on {q.correct} of {q.labelled} "
            f"chosen at random ({q.accuracy:.1%}), calibration error {q.ece:.3f}"
            + (f"; {q.left_out} targeted or trained-on labels not counted" if q.left_out else "")
        )
    for dt, shadow in result.shadows.items():
        typer.echo(f"  dt={dt}  shadow {shadow.line()}")
    if result.paired is not None:
        pair = result.paired
        typer.echo(f"  challenger v{pair.challenger} vs champion v{pair.champion}: {pair.describe()}")
    typer.echo(f"  metrics            {result.metrics_uri}")
