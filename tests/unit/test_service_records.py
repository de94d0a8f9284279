"""PID records of `rayline up`: a record names one process (its boot and start time), not just a number; it is
written whole or not at all; the state folder's lock admits one `up`/`down` at a time.

The processes here are real (this test's own, a `sleep` of its own); tests/e2e/test_failed_up.py drives the CLI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rayline.cli import service_records as records
from rayline.cli.interrupts import interruptible
from rayline.errors import PlatformBusy

pytestmark = pytest.mark.unit


def _record_of_pid(pid: int, tmp_path: Path) -> records.ServiceRecord:
    return records.record_of("ray", pid, ["sleep"], "http://127.0.0.1:1", tmp_path / "ray.log")


def test_a_record_names_its_process_by_boot_and_start_time(tmp_path: Path) -> None:
    with subprocess.Popen(["sleep", "30"], start_new_session=True) as proc:
        try:
            record = _record_of_pid(proc.pid, tmp_path)
            assert record.start_ticks is not None and record.boot_id == records.boot_id()
            assert records.owned(record) and records.leader_runs(record)
            assert not records.owned(record.model_copy(update={"start_ticks": record.start_ticks - 1}))
            assert not records.owned(record.model_copy(update={"boot_id": "an-earlier-boot"}))
            assert not records.owned(record.model_copy(update={"boot_id": None, "start_ticks": None}))
            stale = record.model_copy(update={"start_ticks": record.start_ticks - 1})
            assert records.stop(stale, timeout_s=1) == f"not running (pid {proc.pid} is another process now)"
            assert proc.poll() is None, "a stale record was signalled"
            assert records.stop(record, timeout_s=10, reap=proc.poll) == "stopped"
            assert proc.wait(timeout=5) < 0
        finally:
            proc.kill()


def test_a_group_whose_leader_ended_is_still_stopped(tmp_path: Path) -> None:
    """`ray start --block` dead, its raylet alive: the group still carries the PID, so no other process has it."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 30 & echo $!"], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    record = _record_of_pid(leader.pid, tmp_path)  # not reaped yet: its /proc entry is still there
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    leader.wait()
    leader.stdout.close()
    try:
        assert not records.leader_runs(record) and records.owned(record)
        assert records.stop(record, timeout_s=10) == "stopped"
        assert not Path(f"/proc/{member}").exists()
    finally:
        if records.owned(record):  # the test failed: its sleep goes, and nothing else
            os.killpg(record.pid, signal.SIGKILL)


def test_start_ticks_reads_past_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    odd = tmp_path / "a b) c"
    odd.symlink_to("/bin/sleep")
    with subprocess.Popen([str(odd), "30"]) as proc:
        try:
            ticks = records.start_ticks(proc.pid)
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
            assert "(a b) c)" in stat and ticks == int(stat.split(") c) ")[1].split()[19])
        finally:
            proc.kill()
    assert records.start_ticks(proc.pid) is None, "a reaped process has no start time"


def test_a_record_is_written_whole_and_an_unreadable_one_names_nothing(tmp_path: Path) -> None:
    record = _record_of_pid(os.getpid(), tmp_path)
    records.write_record(tmp_path, record)
    records.write_record(tmp_path, record.model_copy(update={"url": "http://127.0.0.1:2"}))
    assert [p.name for p in (tmp_path / "pids").iterdir()] == ["ray.json"], "no temporary file left behind"
    assert records.read_records(tmp_path)["ray"] == record.model_copy(update={"url": "http://127.0.0.1:2"})
    records.pid_file(tmp_path, "prefect").write_text('{"name": "prefect", "pi')  # torn by an older version
    assert records.read_records(tmp_path) == {"prefect": None, "ray": records.read_records(tmp_path)["ray"]}


def test_the_state_lock_admits_one_command_and_names_the_holder(tmp_path: Path) -> None:
    with records.state_lock(tmp_path, "up"):
        # flock locks belong to an open file, so a second open in this process contends as another process would
        with pytest.raises(PlatformBusy, match=rf"another `rayline up` \(pid {os.getpid()}\) holds the state folder"):
            with records.state_lock(tmp_path, "down"):
                pass
    with records.state_lock(tmp_path, "down"):  # released when the holder ends
        pass


def test_up_stops_on_ctrl_c_and_sigterm_whatever_disposition_it_inherited() -> None:
    """A script's background `rayline up &` starts with SIGINT ignored; its Ctrl-C, and a supervisor's SIGTERM,
    still interrupt `up` (so that it stops what it started), and the inherited dispositions come back after it."""
    inherited_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    inherited_term = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt), interruptible():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)  # not reached: the handler runs at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        with pytest.raises(SystemExit) as exited, interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        assert exited.value.code == 128 + signal.SIGTERM, "the exit status of a process the signal ended"
        assert signal.getsignal(signal.SIGTERM) == inherited_term
    finally:
        signal.signal(signal.SIGINT, inherited_int)
