"""A task of the project's own, run inside its flow beside rayline's."""

from __future__ import annotations

from collections import Counter

from prefect import task


@task
def count_classes(predicted: list[int]) -> dict[str, int]:
    """How many photos of the night each class got, keyed by the class as text (a JSON-friendly report)."""
    return {str(label): n for label, n in sorted(Counter(predicted).items())}
