"""`rayline up` and `down` signal only what they started: never a process a stale PID file names, never the
services of another `up` running at the same time on the same state folder.

Cheap on purpose: each `up` here fails at a port taken by a socket of the test's own or at a PostgreSQL database
that refuses it, before it starts anything, or is interrupted while its services start, so no test starts more
than one Prefect server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayline.cli.platform import SERVICES, ray_temp_dir
from tests.e2e.platform_support import BIN, platform_env, processes_under, run_rayline
from tests.postgres_support import ROLE, PostgresServer
from tests.support import free_port

pytestmark = pytest.mark.e2e

BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@contextlib.contextmanager
def _port_taken(port: str) -> Iterator[None]:
    """A listening socket on ``port``: the port conflict a user meets when something else runs there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", int(port)))
        sock.listen()
        yield


@contextlib.contextmanager
def _bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of someone else's in a session of its own (its PID is its process group), as a reused PID is."""
    proc = subprocess.Popen([shutil.which("sleep") or "sleep", "600"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _write_record(root: Path, name: str, pid: int, command: list[str], *, boot_id: str, start_ticks: int) -> None:
    pids = root / "state" / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name, "pid": pid, "command": command, "url": "http://127.0.0.1:1",
        "log": str(root / "state" / "logs" / f"{name}.log"), "boot_id": boot_id, "start_ticks": start_ticks,
    }  # fmt: skip
    (pids / f"{name}.json").write_text(json.dumps(record))


def _services_gone(root: Path, timeout_s: float = 30) -> list[str]:
    """Processes still running of the services of the state folder under ``root`` (see :func:`_processes_of`)."""
    deadline = time.monotonic() + timeout_s
    while (left := _processes_of(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _processes_of(root: Path) -> list[str]:
    """Processes with ``root`` (the storage root, where the state folder is) in their command line, or the Ray
    head's temp folder, which lives under /tmp when the state folder's path is too long for Ray's sockets."""
    return processes_under(str(root)) + processes_under(str(ray_temp_dir(root / "state")))


def test_a_failed_up_signals_no_process_a_stale_pid_file_names(tmp_path: Path) -> None:
    root = tmp_path / "data"
    env = platform_env(root)
    with _bystander() as bystander:
        # PID files of an earlier boot, whose PIDs the bystander's process has now
        for name in SERVICES:
            command = [str(BIN / ("prefect" if name == "worker" else name)), "start"]
            _write_record(root, name, bystander.pid, command, boot_id="an-earlier-boot", start_ticks=1)
        with _port_taken(env["RAYLINE_PREFECT_PORT"]):
            failed = run_rayline(["up"], env, timeout=120)
        assert failed.returncode != 0, failed.stdout
        assert f"port {env['RAYLINE_PREFECT_PORT']} for the Prefect server" in failed.stderr, failed.stderr
        assert bystander.poll() is None, "the failed `up` signalled the process of a stale PID file"
        stopped = run_rayline(["down"], env, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert bystander.poll() is None, "`down` signalled the process of a stale PID file"
        assert all(f"{name:<12} not running" in stopped.stdout for name in SERVICES), stopped.stdout
    assert not list((root / "state" / "pids").glob("*.json")), "`down` leaves no stale PID file behind"


def test_down_leaves_a_reused_pid_alone_even_when_it_runs_the_recorded_program(tmp_path: Path) -> None:
    root = tmp_path / "data"
    env = platform_env(root)
    with _bystander() as bystander:
        # this boot, the very program recorded, but not the process `up` started (that one began at boot + 10 ms)
        command = [shutil.which("sleep") or "sleep", "600"]
        _write_record(root, "ray", bystander.pid, command, boot_id=BOOT_ID, start_ticks=1)
        stopped = run_rayline(["down"], env, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert bystander.poll() is None, "`down` signalled a process that only shares the recorded PID and program"
        assert f"ray          not running (pid {bystander.pid} is another process now)" in stopped.stdout


def test_two_ups_at_once_neither_orphans_the_other(tmp_path: Path) -> None:
    root = tmp_path / "data"
    env = platform_env(root)
    state = root / "state"
    first = subprocess.Popen(
        [str(BIN / "rayline"), "up"], env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    prefect_pid = None
    try:
        prefect_file = state / "pids" / "prefect.json"
        deadline = time.monotonic() + 60
        while not prefect_file.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        prefect_pid = int(json.loads(prefect_file.read_text())["pid"])
        # frozen while it holds the state folder, its Prefect server (a session of its own) starting
        os.kill(first.pid, signal.SIGSTOP)
        try:
            # generous: on a loaded machine the CLI's imports alone take tens of seconds
            second = run_rayline(["up"], env, timeout=240)
            second_down = run_rayline(["down"], env, timeout=240)
            assert Path(f"/proc/{prefect_pid}").exists(), "the other commands stopped the first `up`'s Prefect"
        finally:
            # then its user presses Ctrl-C: an interrupted `up` stops what it started, as a failed one does (even
            # when it inherited SIGINT ignored, as the background job of a shell without job control does). Sent
            # while it is frozen, so that it lands the moment it runs again: sent after SIGCONT, a test process
            # the machine's load held back between the two let the `up` finish first and end 0.
            os.kill(first.pid, signal.SIGINT)
            frozen_with = _signal_state(first.pid)  # SIGINT pending, caught and not blocked, unless `up` lost it
            os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=120)
        busy = f"another `rayline up` (pid {first.pid}) holds the state folder {state}"
        assert second.returncode != 0 and busy in second.stderr, second.stdout + second.stderr
        assert second_down.returncode != 0 and busy in second_down.stderr, second_down.stdout + second_down.stderr
        assert first.returncode != 0, f"{out}{err}\nthe frozen `up` when SIGINT was sent: {frozen_with}"
        assert _services_gone(root) == [], "a service of either `up` outlived them"
        assert not Path(f"/proc/{prefect_pid}").exists()
        assert not list((state / "pids").glob("*.json")), "the interrupted `up` removes the PID files it wrote"
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
        if prefect_pid is not None:  # a test that failed leaves no Prefect server behind (its group: this test's)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(prefect_pid, signal.SIGKILL)
        _kill_leftovers(root)


def _signal_state(pid: int) -> str:
    """The signal masks /proc shows for ``pid`` (pending, blocked, ignored, caught; each bit n-1 is signal n)."""
    with contextlib.suppress(OSError):
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return "; ".join(line for line in lines if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    return "gone"


def _kill_leftovers(root: Path) -> None:
    """Whatever a failed run of this test left under ``root`` (a Ray head, an MLflow server): not for the rest of
    the suite to carry. Each service runs in a session of its own; this process's group is never signalled."""
    for line in _processes_of(root):
        pid = int(line.split(":", 1)[0])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)


# What `ray start --head --block` shows at its boundary when its node times out during start-up on a loaded
# machine: the GCS port opens, then the command exits (leaving nothing behind) instead of saying it started.
# Run in place of `ray`: the first start fails that way (as often as the count file in argv[2] says), the next
# one starts and blocks, as a started head does.
_HEAD_STAND_IN = """
import socket, sys, time
from pathlib import Path
port, failures = int(sys.argv[1]), Path(sys.argv[2])
gcs = socket.socket()
gcs.bind(("127.0.0.1", port))
gcs.listen()
left = int(failures.read_text())
if left:
    failures.write_text(str(left - 1))
    time.sleep(1.0)
    print("Exception: The current node timed out during startup.", flush=True)
    sys.exit(1)
print("Ray runtime started.", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("failures", "starts"), [(1, 2), (3, 3)], ids=["once", "every-time"])
def test_a_head_dying_during_its_start_up_is_started_again_and_up_never_takes_it_for_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int, starts: int
) -> None:
    """The GCS port open is not a started head: `up` waits for the head to say it started, and starts one that
    exited on the way again (three starts at most), else fails naming its log."""
    from rayline.cli import platform
    from rayline.cli.service_records import read_records, stop
    from rayline.cli.service_starts import Started
    from rayline.config import Settings
    from rayline.errors import ClusterError

    for key, value in platform_env(tmp_path / "root").items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    count = tmp_path / "failures"
    count.write_text(str(failures))
    stand_in = [sys.executable, "-c", _HEAD_STAND_IN, str(settings.ray_port), str(count)]
    monkeypatch.setattr(platform, "_ray_command", lambda state, settings: stand_in)
    state = platform.state_dir(settings)
    started: Started = []
    try:
        ready = platform._start_ray(settings, state, started, platform.endpoints(settings), timeout_s=30)
        if failures < starts:
            ready()
            *failed, (head, proc) = started
            assert proc.poll() is None and read_records(state)["ray"] == head
        else:
            with pytest.raises(ClusterError, match="ray did not come up"):
                ready()
            failed = started
        assert len(started) == starts and all(p.poll() is not None for _, p in failed)
    finally:
        for record, proc in started:
            stop(record, timeout_s=10, reap=proc.poll)


def test_a_wrong_database_password_fails_up_at_once_naming_the_database_not_the_password(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    """`up --database-url` with a wrong password: refused before any service starts, naming each database the
    password was tried on and the reason, never the password."""
    root = tmp_path / "data"
    env = platform_env(root)
    wrong = "not-the-password-" + os.urandom(4).hex()
    failed = run_rayline(["up", "--database-url", postgres.url(password=wrong)], env, timeout=120)
    assert failed.returncode != 0, failed.stdout
    for whose, database in (("the Prefect server", "prefect"), ("MLflow", "mlflow")):
        masked = f"postgresql://{ROLE}:***@127.0.0.1:{postgres.port}/{database}"
        assert f"{whose}'s database {masked}: authentication failed for user {ROLE}" in failed.stderr, failed.stderr
    assert wrong not in failed.stdout + failed.stderr
    assert not list(root.glob("state/pids/*.json")) and not list(root.glob("state/logs/*.log")), "nothing started"
    assert _processes_of(root) == []


@pytest.mark.parametrize("fault", ["missing database", "refused"])
def test_a_database_that_cannot_serve_is_named_with_the_reason(postgres: PostgresServer, fault: str) -> None:
    """The check `up` makes first, on the two other ways a URL fails: no such database, nothing listening."""
    from rayline.cli.platform_database import check, parse
    from rayline.errors import DatabaseUnusable

    if fault == "missing database":
        database, reason = parse(postgres.url("prefect_typo")), "database prefect_typo does not exist; create it"
    else:
        closed = free_port()  # nothing listens there
        database = parse(postgres.url().replace(f":{postgres.port}/", f":{closed}/"))
        reason = f"connection refused (is PostgreSQL listening on 127.0.0.1:{closed}?)"
    with pytest.raises(DatabaseUnusable) as refused:
        check([("the Prefect server", database)])
    where = f"postgresql://{ROLE}:***@127.0.0.1:{database.port}/{database.name}"
    assert str(refused.value) == f"the Prefect server's database {where}: {reason}" + (
        f" (CREATE DATABASE prefect_typo OWNER {ROLE})" if fault == "missing database" else ""
    )
    assert postgres.password not in str(refused.value)
