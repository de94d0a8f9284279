"""The CLI's progress: stages counted by workloads, shown as a few plain lines off a terminal."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from rayline import progress
from rayline.cli.console import PlainReporter, log_path

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def shown() -> Iterator[tuple[list[str], Clock]]:
    lines: list[str] = []
    clock = Clock()
    progress.install(PlainReporter(echo=lines.append, clock=clock, interval_s=30.0))
    try:
        yield lines, clock
    finally:
        progress.install(None)


def test_without_a_reporter_a_stage_counts_nothing_and_costs_nothing() -> None:
    with progress.stage("ingest", total=10, unit="objects") as stage:
        stage.add(5)
        stage.set(10)
    assert stage == progress.Stage()  # no key, no actor: every call returns at once


def test_plain_lines_a_few_per_stage_not_one_per_update(shown: tuple[list[str], Clock]) -> None:
    lines, clock = shown
    with progress.stage("preprocess", total=1801, unit="images") as stage:
        for _ in range(100):  # many quick updates: no line
            stage.add(1)
        clock.now = 31.0  # a long stage: one line now and then says how far it got
        stage.add(400)
        stage.add(1)  # within the interval again: no line
        clock.now = 40.0
        stage.set(1801)
    assert lines == [
        "  … preprocess         500/1801 images after 31 s",
        "  done preprocess         1801/1801 images in 40.0 s",
    ]


def test_a_failed_stage_says_so_and_late_counts_are_ignored(shown: tuple[list[str], Clock]) -> None:
    lines, _ = shown
    with pytest.raises(RuntimeError), progress.stage("train", total=12, unit="epochs") as stage:
        stage.set(3)
        raise RuntimeError("worker lost")
    stage.set(4)  # a straggler after the end: nothing
    assert lines == ["  FAILED train              3/12 epochs in 0.0 s"]


def test_a_counter_pickles_for_other_processes(shown: tuple[list[str], Clock]) -> None:
    with progress.stage("tune", total=4, unit="trials") as stage:
        again = pickle.loads(pickle.dumps(stage))
        again.add(1)  # in the showing process a copy counts directly
    assert shown[0] == ["  done tune               1/4 trials in 0.0 s"]


def test_logs_go_under_the_state_folder_by_command_and_time(tmp_path: Path) -> None:
    assert log_path(tmp_path, "demo", datetime(2026, 12, 1, 7, 45, 3)) == tmp_path / "logs" / "demo-20261201-074503.log"
