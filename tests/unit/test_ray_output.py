"""Where Ray's own output goes once the CLI sends it to its log file (``ray_cluster.send_worker_logs_to``)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from rayline import ray_cluster

pytestmark = pytest.mark.unit

# What the raylet pushes to the driver, as ``listen_error_messages`` hands it on (seen in `make demo`).
PUSHED = {
    "lines": [
        "WARNING: 8 PYTHON worker processes have been started on node: abc with address: 127.0.0.1. "
        "This could be a result of using a large number of actors, or tasks blocked in ray.get() calls"
    ],
    "pid": "raylet",
    "is_err": False,
}


@pytest.fixture
def log_file() -> Iterator[io.StringIO]:
    sink = io.StringIO()
    ray_cluster.send_worker_logs_to(sink)
    try:
        yield sink
    finally:
        ray_cluster.send_worker_logs_to(None)


def test_the_messages_ray_pushes_to_the_driver_go_to_the_log_file(
    log_file: io.StringIO, capsys: pytest.CaptureFixture[str]
) -> None:
    from ray._private import worker

    worker.print_to_stdstream(dict(PUSHED), ignore_prefix=False)  # what Ray's error-listener thread calls

    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == "", "Ray's warning reached the terminal"
    assert "8 PYTHON worker processes have been started" in log_file.getvalue()


def test_without_a_log_file_ray_prints_as_it_always_did(capsys: pytest.CaptureFixture[str]) -> None:
    from ray._private import worker

    ray_cluster.send_worker_logs_to(None)
    worker.print_to_stdstream({**PUSHED, "lines": ["a line of its own"]}, ignore_prefix=False)
    assert "a line of its own" in capsys.readouterr().out
