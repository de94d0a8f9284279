"""The monitor's chart: a night's predicted-class shares beside its reference's (matplotlib, Agg)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rayline.ray_workloads.monitoring.monitor import PartitionDrift

# Bars in the distribution chart: 1,000 ImageNet classes would be unreadable.
_CHART_CLASSES = 20


def distribution_png(drift: PartitionDrift) -> bytes | None:
    """Predicted-class shares of a partition next to the reference shares (the most common classes); None
    without matplotlib (the ``rayline[train]`` extra): the monitor's artifact is then its table alone."""
    import io

    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
