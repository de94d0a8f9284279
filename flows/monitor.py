"""Flow ``monitor``: serving health and prediction drift; emits events when thresholds are crossed."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows.nightly_inference import PREDICTIONS_DIR
from flows.serve_rollout import serve_config
from ray_workloads import monitor as mon
from ray_workloads import preprocess
from rayline import registry, storage
from tasks import events
from tasks.train import png_markdown

MONITORING_DIR = "monitoring"
METRICS_FILE = "metrics.prom"


class MonitorResult(BaseModel):
    serving: mon.ServingHealth | None
    partitions: list[mon.PartitionDrift]
    metrics_uri: str

    @property
    def drifted(self) -> list[mon.PartitionDrift]:
        return [p for p in self.partitions if p.drifted]


def _markdown(result: MonitorResult) -> str:
    lines = ["### rayline monitor", ""]
    if result.serving is not None:
        s = result.serving
        lines += [f"**Serving** {s.url}: {'healthy' if s.healthy else 'UNHEALTHY — ' + str(s.problem)}", ""]
        if s.versions:
            lines += ["| version | weight | requests | errors | p95 ms |", "|---|---|---|---|---|"]
            lines += [
                f"| v{v.version} | {v.weight:g} | {v.requests} | {v.errors} | "
                f"{'-' if v.p95_ms is None else f'{v.p95_ms:.1f}'} |"
                for v in s.versions
            ]
            lines.append("")
    lines += [
        "| partition | model | inputs | errors | class PSI | low-confidence | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.partition_uri.rsplit('/', 1)[-1]} | {p.model} | {p.inputs} | {p.errors} | {p.psi:.3f} | "
        f"{p.low_confidence_share:.1%} | {'DRIFT: ' + '; '.join(p.reasons) if p.drifted else 'ok'} |"
        for p in result.partitions
    ]
    return "\n".join(lines) + "\n\n" + f"Prometheus metrics: `{result.metrics_uri}`\n"


@flow(name="monitor")
def monitor(
    model_name: str = "digits",
    partitions: int = 1,
    check_serving: bool = True,
    psi_threshold: float = 0.2,
    max_low_confidence_share: float = 0.3,
    max_error_fraction: float = 0.05,
) -> MonitorResult:
    """Check serving health and the latest ``partitions`` committed prediction partitions for drift."""
    thresholds = mon.DriftThresholds(
        psi=psi_threshold, max_low_confidence_share=max_low_confidence_share, max_error_fraction=max_error_fraction
    )
    logger = get_run_logger()
    root = storage.storage_root()
    champion = registry.resolve(model_name, registry.CHAMPION)
    reference = preprocess.read_manifest(champion.data_manifest_uri).class_counts["train"]
    cfg = serve_config()
    serving = mon.serving_health(f"http://{cfg.host}:{cfg.port}", thresholds) if check_serving else None
    drifts = [
        mon.partition_drift(uri, reference, thresholds)
        for uri in mon.committed_partitions(storage.join(root, PREDICTIONS_DIR), partitions)
    ]
    run_id = str(flow_run.get_id() or "local")
    metrics_uri = storage.join(root, MONITORING_DIR, METRICS_FILE)
    storage.write_bytes_atomic(metrics_uri, mon.prometheus_text(serving, drifts, run_id).encode())
    result = MonitorResult(serving=serving, partitions=drifts, metrics_uri=metrics_uri)

    for drift in result.drifted:
        logger.warning("drift in %s: %s", drift.partition_uri, "; ".join(drift.reasons))
        events.emit(
            events.DRIFT_DETECTED,
            f"rayline.predictions.{drift.partition_uri}",
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
    if serving is not None and serving.reachable and not serving.healthy:
        logger.warning("serving unhealthy: %s", serving.problem)
        events.emit(events.HEALTH_DEGRADED, f"rayline.serve.{serving.url}", payload=serving.model_dump())
    markdown = _markdown(result)
    if drifts:
        markdown += "\n" + png_markdown("Predicted classes vs training labels", mon.distribution_png(drifts[0]))
    create_markdown_artifact(key="monitor", markdown=markdown)
    return result
