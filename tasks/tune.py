"""Prefect task: hyper-parameter search with Ray Tune (ASHA)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from rayline import storage
from rayline.ray_workloads.training import evaluate, tune
from rayline.ray_workloads.training.loop import TrainLoopConfig
from rayline.tasks.common import png_markdown, ray_task, record_lineage


@ray_task("tune")
def tune_task(config: tune.TuneJobConfig, base: TrainLoopConfig) -> tune.TuneResult:
    result = tune.run(config, base)
    get_run_logger().info(
        "tune %s: %d trials%s, best val accuracy %.4f with lr %.4g, batch %d, width %d, arch %s",
        config.experiment_name,
        len(result.trials),
        " (restored)" if result.restored else "",
        result.best_metrics["val_accuracy"],
        result.best_config.lr,
        result.best_config.batch_size,
        result.best_config.model.width,
        result.best_config.model.arch,
    )
    rows = trial_rows(result)
    get_run_logger().info("Ray Tune trials (best first):\n%s", text_table(rows))
    create_table_artifact(
        key="tune-trials",
        table=rows,
        description=f"ASHA search `{config.experiment_name}`; trials stopped early ran fewer epochs",
    )
    series = {
        t.trial_id or str(i): [(float(epoch), acc) for epoch, acc in enumerate(t.curve or [t.val_accuracy], start=1)]
        for i, t in enumerate(result.trials)
    }
    png = evaluate.curves_png(series, "val accuracy", "Tune trials (ASHA): validation accuracy per epoch")
    png_uri = storage.join(result.experiment_uri, "trials.png")
    storage.write_bytes_atomic(png_uri, png)
    create_markdown_artifact(key="tune-trials-plot", markdown=png_markdown("Tune trials", png, png_uri))
    record_lineage("tune", result, parameters=config.model_dump(mode="json"))
    return result


def trial_rows(result: tune.TuneResult) -> list[dict[str, Any]]:
    """One row per trial, best first: what ASHA ran and where it stopped it."""
    return [
        {
            "trial": t.trial_id,
            "epochs": t.epochs,
            "val_accuracy": round(t.val_accuracy, 4),
            "status": t.status,
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in t.config.items()},
        }
        for t in sorted(result.trials, key=lambda t: -t.val_accuracy)
    ]


def text_table(rows: list[dict[str, Any]]) -> str:
    """Rows as aligned text columns, for a log line."""
    if not rows:
        return "(none)"
    columns = list(rows[0])
    cells = [[str(c) for c in columns]] + [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in cells)
