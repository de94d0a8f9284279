"""Ray's native warnings stay off a quiet CLI's terminal: the driver's core worker writes them to fd 2 itself.

A child process opens the CLI's quiet terminal, starts a Ray cluster of its own and creates a restartable
actor whose constructor argument is in the object store: the driver's core worker (C++) warns about it,
as it does for every Ray Data actor pool. The warning must land in the command's log
file, while what rayline and Python print to stderr still reaches the terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NATIVE_WARNING = "has constructor arguments in the object store"

PROBE = textwrap.dedent(
    """
    import logging
    import sys
    from pathlib import Path

    import ray
    import typer

    from rayline.cli import console

    terminal = console.open_terminal("probe", Path(sys.argv[1]), verbose=False, tty=False)
    print("a line of python's own", file=sys.stderr)
    ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1")


    @ray.remote(max_restarts=1, num_cpus=0)
    class Holder:
        def __init__(self, value: bytes) -> None:
            self.size = len(value)

        def size_of(self) -> int:
            return self.size


    held = ray.put(b"x" * 500_000)  # in the object store, passed by reference
    assert ray.get(Holder.remote(held).size_of.remote()) == 500_000
    typer.echo("an error message of rayline's", err=True)
    logging.getLogger("ray").error("an error record of ray's")  # by Ray's own terminal handler, which moved
    terminal.close()
    ray.shutdown()
    """
)


def test_the_core_workers_own_warnings_go_to_the_log_file_and_rayline_keeps_the_terminal(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logs = list((tmp_path / "logs").glob("probe-*.log"))
    assert len(logs) == 1, logs
    logged = logs[0].read_text()

    assert NATIVE_WARNING in logged, f"the core worker gave no warning to check against:\n{logged[-3000:]}"
    assert NATIVE_WARNING not in done.stderr + done.stdout, done.stderr[-3000:]
    assert "a line of python's own" in done.stderr
    assert "an error message of rayline's" in done.stderr
    assert "an error record of ray's" in done.stderr
    assert "(--verbose prints them)" in done.stderr  # where to look, said on the terminal
