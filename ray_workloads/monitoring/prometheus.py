"""The monitor's reading as Prometheus text (``prometheus_client``: escaping, types, HELP), the file
``monitoring/<model>.prom`` that node-exporter's textfile collector serves."""

from __future__ import annotations

import time as time_module
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, date, datetime, time
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from rayline.ray_workloads.monitoring.monitor import DriftThresholds, PartitionDrift, ServingHealth
    from rayline.ray_workloads.quality.metrics import NightQuality
    from rayline.ray_workloads.quality.paired import PairedTest
    from rayline.ray_workloads.quality.shadow import ShadowSummary

_Row = TypeVar("_Row")  # what one labelled row of gauges is read from: a night, a shadow, a version's quality


class _Snapshot:
    """A prometheus_client collector that yields metric families built once (the monitor's one reading)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _gauges(
    rows: Sequence[tuple[dict[str, str], _Row]], specs: Sequence[tuple[str, str, Callable[[_Row], float]]]
) -> list[Metric]:
    """A gauge family per (name, help, value of a row), each over the same labelled rows."""
    return [
        _family(GaugeMetricFamily, name, help_text, [(labels, value(row)) for labels, row in rows])
        for name, help_text, value in specs
    ]


def _family(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    help_text: str,
    samples: Sequence[tuple[dict[str, str], float]],
) -> Metric:
    labels = list(samples[0][0]) if samples else []
    family = kind(name, help_text, labels=labels)
    for values, value in samples:
        family.add_metric([values[k] for k in labels], value)
    return family


def prometheus_text(
    health: ServingHealth | None,
    drifts: list[PartitionDrift],
    model: str = "digits",
    quality: Sequence[NightQuality] = (),
    *,
    paired: PairedTest | None = None,
    thresholds: DriftThresholds | None = None,
    now: float | None = None,
    shadows: Mapping[str, ShadowSummary] | None = None,
) -> str:
    """The monitor's reading in Prometheus' text format.

    Labels stay bounded, as Prometheus asks: model, stage, model version, and for nights ``night``, how many
    committed nights back (0: the newest); a night's date is a gauge's value and no per-run id is a label,
    so each run replaces the same series. Labelled quality and ``shadows`` (by night, the version scored in
    its shadow, in ``model_version``) count nights back the same way. ``now`` tells a stale file from a
    quiet model; ``thresholds`` are exported so alert rules compare against the limits the monitor used.
    """
    ran = {"model": model}
    families: list[Metric] = [
        _family(GaugeMetricFamily, "rayline_monitor_last_run_timestamp_seconds", "When the monitor wrote this file.",
                [(ran, time_module.time() if now is None else now)]),
    ]  # fmt: skip
    families += _threshold_families(ran, thresholds) if thresholds is not None else []
    families += _serving_families(model, health) if health is not None else []
    batch = [
        ({"model": model, "stage": "batch_inference", "model_version": d.model, "night": str(back)}, d)
        for back, d in enumerate(sorted(drifts, key=lambda d: d.dt, reverse=True))
    ]
    families += _night_families(batch)
    families += _shadow_families(model, [d.dt for _, d in batch], shadows or {})
    families += _quality_families(model, quality)
    families += _paired_families(model, paired) if paired is not None else []
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry).decode()


def _threshold_families(ran: dict[str, str], thresholds: DriftThresholds) -> list[Metric]:
    return [
        _family(GaugeMetricFamily, "rayline_predictions_error_budget_fraction",
                "The share of a night's inputs that may get error rows (the monitor's max_error_fraction).",
                [(ran, thresholds.max_error_fraction)]),
        _family(GaugeMetricFamily, "rayline_predictions_psi_threshold", "The class PSI the monitor calls drift.",
                [(ran, thresholds.psi)]),
    ]  # fmt: skip


def _serving_families(model: str, health: ServingHealth) -> list[Metric]:
    serve = {"model": model, "stage": "serve"}
    per_version = [({**serve, "model_version": str(v.version)}, v) for v in health.versions]
    return [
        _family(GaugeMetricFamily, "rayline_serve_up", "1 when the router answers and some version takes traffic.",
                [(serve, float(health.healthy and health.served))]),
        _family(CounterMetricFamily, "rayline_serve_requests", "Requests answered per version since stats reset.",
                [(labels, v.requests) for labels, v in per_version]),
        _family(CounterMetricFamily, "rayline_serve_errors", "5xx answers per version since the stats reset.",
                [(labels, v.errors) for labels, v in per_version]),
        _family(GaugeMetricFamily, "rayline_serve_weight", "Traffic weight per version.",
                [(labels, v.weight) for labels, v in per_version]),
        _family(GaugeMetricFamily, "rayline_serve_champion_mismatch",
                "1 when the version with the most traffic is not the registry's champion and no rollout runs.",
                [(serve, float(health.champion_mismatch))]),
    ]  # fmt: skip


def _night_families(batch: list[tuple[dict[str, str], PartitionDrift]]) -> list[Metric]:
    costed = [(labels, d) for labels, d in batch if d.core_seconds]  # nights committed with their CPU figure
    return _gauges(costed, [
        ("rayline_predictions_core_seconds", "CPU seconds a night's run took: its actors' and its driver's.",
         lambda d: d.core_seconds or 0.0),
        ("rayline_predictions_images_per_core_second", "A night's inputs per CPU second: what a core buys.",
         lambda d: d.inputs / (d.core_seconds or 1.0)),
    ]) + _gauges(batch, [
        ("rayline_predictions_night_timestamp_seconds", "The night's date (UTC midnight).",
         lambda d: _night_timestamp(d.dt)),
        ("rayline_predictions_rows", "Prediction rows of a committed night.", lambda d: d.predictions),
        ("rayline_predictions_error_fraction", "Inputs of a night that got an error row.", lambda d: d.error_fraction),
        ("rayline_predictions_class_psi", "PSI of predicted classes vs the reference (training labels or a reference "
         "night).", lambda d: d.psi),
        ("rayline_predictions_low_confidence_share", "Share of predictions under the confidence floor.",
         lambda d: d.low_confidence_share),
        ("rayline_predictions_drifted", "1 when the monitor judged the night drifted.", lambda d: float(d.drifted)),
    ])  # fmt: skip


def _paired_families(model: str, paired: PairedTest) -> list[Metric]:
    pair = {"model": model, "champion": str(paired.champion), "challenger": str(paired.challenger)}
    return [
        _family(GaugeMetricFamily, "rayline_quality_paired_outcome",
                "The paired test of the challenger against the champion: 1 better, -1 not better, 0 not yet known.",
                [(pair, PAIRED_OUTCOME_VALUE[paired.outcome])]),
        _family(GaugeMetricFamily, "rayline_quality_paired_labelled",
                "Labelled photos both the champion and the challenger predicted.", [(pair, paired.paired)]),
    ]  # fmt: skip


def _shadow_families(model: str, nights: list[str], shadows: Mapping[str, ShadowSummary]) -> list[Metric]:
    rows = [
        ({"model": model, "model_version": str(shadows[dt].model_version), "night": str(back)}, shadows[dt])
        for back, dt in enumerate(nights)
        if dt in shadows
    ]
    return _gauges(rows, [
        ("rayline_shadow_agreement", "Share of the night's images the shadow version predicted as the champion did.",
         lambda s: s.agreement),
        ("rayline_shadow_confidence_change", "The shadow's mean top-1 confidence minus the champion's, on the same "
         "images.", lambda s: s.confidence_change),
        ("rayline_shadow_class_shift", "Total variation distance between the two versions' predicted-class "
         "distributions.", lambda s: s.class_shift),
    ])  # fmt: skip


PAIRED_OUTCOME_VALUE = {"passed": 1.0, "inconclusive": 0.0, "failed": -1.0}


def _quality_families(model: str, quality: Sequence[NightQuality]) -> list[Metric]:
    """Each version's labelled figures per night; ``night`` counts back among the nights with labels, ``role``
    says whether the version served the night or was scored in its shadow."""
    back = {dt: i for i, dt in enumerate(sorted({q.dt for q in quality}, reverse=True))}
    rows = [
        ({"model": model, "model_version": str(q.model_version), "night": str(back[q.dt]), "role": q.role}, q)
        for q in quality
    ]
    recall = [({**labels, "class": name}, share) for labels, q in rows for name, share in q.recall.items()]
    return [
        *_gauges(rows, [
            ("rayline_quality_night_timestamp_seconds", "The labelled night's date (UTC).",
             lambda q: _night_timestamp(q.dt)),
            ("rayline_quality_labelled", "Labelled photos of the night the version predicted.", lambda q: q.labelled),
            ("rayline_quality_accuracy", "Share of the labelled photos predicted right.", lambda q: q.accuracy),
            ("rayline_quality_ece", "Expected calibration error on the labelled photos.", lambda q: q.ece),
        ]),
        _family(GaugeMetricFamily, "rayline_quality_class_recall", "Per labelled class: the share predicted as it.",
                recall),
    ]  # fmt: skip


def _night_timestamp(dt: str) -> float:
    return datetime.combine(date.fromisoformat(dt), time.min, tzinfo=UTC).timestamp()
