"""The monitor's charts (matplotlib, Agg): a night's predicted-class shares beside its reference's, and
each version's labelled accuracy night by night."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rayline.ray_workloads.monitoring.monitor import PartitionDrift
    from rayline.ray_workloads.quality.metrics import NightQuality

# Bars in the distribution chart: 1,000 ImageNet classes would be unreadable.
_CHART_CLASSES = 20


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; None without matplotlib (the ``rayline[train]`` extra): the
    monitor's artifact is then its tables alone."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any, plt: Any) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def accuracy_png(quality: Sequence[NightQuality]) -> bytes | None:
    """Labelled accuracy over nights, a line per version (its labelled count beside each point)."""
    plt = _pyplot()
    if plt is None or not quality:
        return None
    nights = sorted({q.dt for q in quality})
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(nights)), 3.5), dpi=100)
    for version in sorted({q.model_version for q in quality}):
        mine = sorted((q for q in quality if q.model_version == version), key=lambda q: q.dt)
        x = [nights.index(q.dt) for q in mine]
        ax.plot(x, [q.accuracy for q in mine], marker="o", label=f"v{version}")
        for xi, q in zip(x, mine, strict=True):
            ax.annotate(str(q.labelled), (xi, q.accuracy), textcoords="offset points", xytext=(0, 6), fontsize=7)
    ax.set_xticks(range(len(nights)), nights, rotation=45 if len(nights) > 6 else 0, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("labelled accuracy")
    ax.set_title("Accuracy on labelled photos, per version (labelled count above each night)")
    ax.legend()
    return _png(fig, plt)


def distribution_png(drift: PartitionDrift) -> bytes | None:
    """Predicted-class shares of a partition next to the reference shares (the most common classes)."""
    plt = _pyplot()
    if plt is None:
        return None

    keys = sorted(set(drift.reference_share) | set(drift.class_share))
    if len(keys) > _CHART_CLASSES:
        top = sorted(keys, key=lambda k: -max(drift.reference_share.get(k, 0), drift.class_share.get(k, 0)))
        keys = sorted(top[:_CHART_CLASSES])
    x = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(keys)), 3.5), dpi=100)
    ax.bar(x - 0.2, [drift.reference_share.get(k, 0) for k in keys], 0.4, label=drift.reference)
    ax.bar(x + 0.2, [drift.class_share.get(k, 0) for k in keys], 0.4, label="predicted")
    ax.set_xticks(x, keys, rotation=45 if len(keys) > 10 else 0, ha="right" if len(keys) > 10 else "center")
    ax.set_ylabel("share")
    ax.set_title(f"{drift.partition}: PSI {drift.psi:.3f}")
    ax.legend()
    return _png(fig, plt)
