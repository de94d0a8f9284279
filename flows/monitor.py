"""Flow ``monitor``: serving health and prediction drift; emits events when thresholds are crossed.

It also vacuums the two night tables: files no version within ``vacuum_retention_hours`` needs are deleted,
so every version current within it stays readable by number (``rayline.tables.prediction_reads``).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from rayline import events
from rayline.errors import RaylineError
from rayline.models.registry import CHALLENGER, CHAMPION
from rayline.ray_workloads.monitoring import monitor as mon
from rayline.ray_workloads.monitoring.request import MonitorRequest as MonitorRequest  # callers import it with the flow
from rayline.ray_workloads.quality.metrics import NightQuality
from rayline.ray_workloads.quality.paired import PairedTest
from rayline.ray_workloads.quality.shadow import ShadowSummary
from rayline.ray_workloads.serving.config import config_from_settings
from rayline.storage.layout import metrics_uri as metrics_file_uri
from rayline.storage.layout import root_uri
from rayline.tasks.common import emit, png_markdown
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.maintenance import vacuum_tables_task
from rayline.tasks.monitoring import (
    labelled_quality_task,
    night_drifts_task,
    reference_task,
    serving_health_task,
    shadow_nights_task,
    write_metrics_task,
)
from rayline.tasks.registry_lookups import alias_version_task, reconcile_mirror_task, resolve_version_task


class MonitorResult(BaseModel):
    serving: mon.ServingHealth | None
    partitions: list[mon.PartitionDrift]
    quality: list[NightQuality] = Field(default_factory=list, description="Each version's labelled figures.")
    paired: PairedTest | None = Field(None, description="The challenger against the champion on labelled photos.")
    shadows: dict[str, ShadowSummary] = Field(default_factory=dict, description="By night: its shadow's comparison.")
    metrics_uri: str
    files_vacuumed: int | None = Field(None, description="Files the vacuum deleted; None: none ran.")
    vacuum_retention_hours: int | None = None

    @property
    def drifted(self) -> list[mon.PartitionDrift]:
        return [p for p in self.partitions if p.drifted]


def _markdown(result: MonitorResult, vacuum_error: Exception | None = None) -> str:
    lines = ["### rayline monitor", ""]
    if result.serving is not None:
        s = result.serving
        lines += [f"**Serving** {s.url}: {'healthy' if s.healthy else 'UNHEALTHY — ' + str(s.problem)}", ""]
        if s.stats_problem is not None:
            lines += [f"Per-version figures: none ({s.stats_problem})", ""]
        if s.versions:
            lines += ["| version | weight | requests | errors | p95 ms |", "|---|---|---|---|---|"]
            lines += [
                f"| v{v.version} | {v.weight:g} | {v.requests} | {v.errors} | "
                f"{'-' if v.p95_ms is None else f'{v.p95_ms:.1f}'} |"
                for v in s.versions
            ]
            lines.append("")
    lines += [
        "| night | Delta version | model | inputs | errors | class PSI | vs | low-confidence | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.partition} | {p.version} | {p.model} | {p.inputs} | {p.errors} | {p.psi:.3f} | {p.reference} | "
        f"{p.low_confidence_share:.1%} | {'DRIFT: ' + '; '.join(p.reasons) if p.drifted else 'ok'} |"
        for p in result.partitions
    ]
    lines += _quality_lines(result.quality)
    if result.paired is not None:
        lines += ["", f"**Challenger v{result.paired.challenger} vs champion**: {result.paired.describe()}"]
    lines += ["", _vacuum_line(result, vacuum_error), "", f"Prometheus metrics: `{result.metrics_uri}`"]
    return "\n".join(lines) + "\n"


def _quality_lines(quality: list[NightQuality]) -> list[str]:
    if not quality:
        return [
            "",
            "**Labelled quality**: no labels chosen at random on these nights yet (`rayline labels queue`, then "
            "`rayline labels import`)",
        ]
    lines = ["", "**Labelled quality** (labels chosen at random: an estimate of each version's accuracy on the night)"]
    lines += ["", "| night | version | labelled | accuracy | ECE | not counted |", "|---|---|---|---|---|---|"]
    return lines + [
        f"| dt={q.dt} | v{q.model_version} | {q.labelled} | {q.accuracy:.1%} | {q.ece:.3f} | {q.left_out} |"
        for q in quality
    ]


def _vacuum_line(result: MonitorResult, error: Exception | None) -> str:
    if result.vacuum_retention_hours is None:
        return "**Vacuum** of the night tables: off"
    head = f"**Vacuum** of the night tables (retention {result.vacuum_retention_hours} h): "
    return head + (f"FAILED: {error}" if error is not None else f"{result.files_vacuumed} files deleted")


@openlineage_flow
@flow(name="monitor")
def monitor(request: MonitorRequest = MonitorRequest()) -> MonitorResult:  # noqa: B008  # frozen: one default
    """Check serving health and the latest committed nights of the request's model for drift.

    By default a trained champion is compared with its training labels and an outside one with its first
    committed night. Each version's labelled quality covers the latest ``quality_nights`` committed nights that
    have labels. Then vacuums both night tables, for real (``vacuum_retention_hours`` None: no vacuum); a failed
    vacuum fails the run after the checks are published.
    """
    model_name, thresholds = request.model_name, request.thresholds
    reference_date = request.reference_date.isoformat() if request.reference_date else None
    root = root_uri()
    champion = resolve_version_task(model_name, CHAMPION)
    reconcile_mirror_task(champion.name)  # every 15 min: completes a mirror that failed earlier (never raises)
    reference = reference_task(champion, root, reference_date, thresholds.low_confidence)
    get_run_logger().info("judging %s v%d's nights against %s", model_name, champion.version, reference.describe())
    serving = _serving_health(thresholds, model_name) if request.check_serving else None
    drifts = night_drifts_task(root, model_name, request.partitions, reference, thresholds)
    challenger = alias_version_task(champion.name, CHALLENGER)
    labelled = labelled_quality_task(
        root, model_name, champion.classes, request.quality_nights, champion.version, challenger
    )
    result = MonitorResult(
        serving=serving,
        partitions=drifts,
        quality=labelled.nights,
        paired=labelled.paired,
        shadows=shadow_nights_task(root, model_name, [d.dt for d in drifts]),
        metrics_uri=metrics_file_uri(root, model_name),
        vacuum_retention_hours=request.vacuum_retention_hours,
    )
    text = mon.prometheus_text(
        serving, drifts, model_name, result.quality, paired=result.paired, thresholds=thresholds, shadows=result.shadows
    )
    write_metrics_task(result.metrics_uri, text)
    _announce(result, thresholds, model_name)
    # last: upkeep, which must not hold back the checks' events
    result.files_vacuumed, vacuum_error = _vacuum(root, request.vacuum_retention_hours)
    _publish(result, vacuum_error)
    if vacuum_error is not None:
        raise vacuum_error
    return result


def _serving_health(thresholds: mon.DriftThresholds, model_name: str) -> mon.ServingHealth:
    cfg = config_from_settings()
    return serving_health_task(f"http://{cfg.host}:{cfg.port}", thresholds, model_name)


def _announce(result: MonitorResult, thresholds: mon.DriftThresholds, model_name: str) -> None:
    """An event for each night that drifted, and one for unhealthy serving."""
    logger = get_run_logger()
    for drift in result.drifted:
        logger.warning("drift in %s: %s", drift.night, "; ".join(drift.reasons))
        emit(
            events.DRIFT_DETECTED,
            f"rayline.predictions.{drift.night}",
            payload={
                "metric": "predicted_class_psi",
                "value": drift.psi,
                "threshold": thresholds.psi,
                "low_confidence_share": drift.low_confidence_share,
                "reasons": drift.reasons,
                "model": model_name,
            },
            labels={"rayline.model": model_name},
        )
    serving = result.serving
    if serving is not None and serving.reachable and not serving.healthy:
        logger.warning("serving unhealthy: %s", serving.problem)
        emit(events.HEALTH_DEGRADED, f"rayline.serve.{serving.url}", payload=serving.model_dump())


def _publish(result: MonitorResult, vacuum_error: Exception | None) -> None:
    """The run's markdown artifact: the checks, the vacuum, and the charts."""
    markdown = _markdown(result, vacuum_error)
    drifts = result.partitions
    chart = mon.distribution_png(drifts[0]) if drifts else None
    if chart is not None:
        markdown += "\n" + png_markdown(f"Predicted classes vs {drifts[0].reference}", chart)
    accuracy_chart = mon.accuracy_png(result.quality)
    if accuracy_chart is not None:
        markdown += "\n" + png_markdown("Labelled accuracy per version, night by night", accuracy_chart)
    create_markdown_artifact(key="monitor", markdown=markdown)


def _vacuum(root: str, retention_hours: int | None) -> tuple[int | None, RaylineError | None]:
    """Files the vacuum deleted (None when off or failed), and its error: the checks get published either way."""
    if retention_hours is None:
        return None, None
    try:
        return vacuum_tables_task(root, retention_hours), None
    except RaylineError as exc:
        get_run_logger().error("vacuum of the night tables failed: %s", exc)
        return None, exc
