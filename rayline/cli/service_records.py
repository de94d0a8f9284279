"""The state folder of ``rayline up``: a PID record per service, and the lock that runs one ``up``/``down`` at a time.

A PID alone names a process only until it exits: the kernel hands the number to the next process, and a PID
file outlives a reboot. So a record also holds what the kernel says about the process it started (the boot's
id and the process's start time in clock ticks since boot, ``/proc/<pid>/stat`` field 22), and rayline
signals a recorded process group only while that identity still holds (``owned``). A record that fails it is
stale: it is reported and removed, never signalled.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel, ValidationError

from rayline.errors import PlatformBusy

SERVICES = ("prefect", "ray", "mlflow", "worker")  # started in this order, stopped in the reverse
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class ServiceRecord(BaseModel):
    name: str
    pid: int  # also the process group's id: each service runs in a session of its own
    command: list[str]
    url: str
    log: str
    # the identity of the process `up` started; None in records of older versions, which are never trusted
    boot_id: str | None = None
    start_ticks: int | None = None


def pid_file(state: Path, name: str) -> Path:
    return state / "pids" / f"{name}.json"


def boot_id() -> str:
    return _BOOT_ID.read_text().strip()


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or ')': count fields after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])


def record_of(name: str, pid: int, command: list[str], url: str, log: Path) -> ServiceRecord:
    """The record of a process this call just started (its child, so its PID cannot have been reused yet)."""
    return ServiceRecord(
        name=name, pid=pid, command=command, url=url, log=str(log), boot_id=boot_id(), start_ticks=start_ticks(pid)
    )


def write_record(state: Path, record: ServiceRecord) -> None:
    """Write the record whole or not at all: a temporary file in the same folder, renamed over the old one. Not
    fsynced: a power loss takes the recorded processes with it, and the new boot id marks the record stale."""
    path = pid_file(state, record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(record.model_dump_json())
        os.replace(temp, path)
    except BaseException:  # an interrupt too must not leave the temp file behind; re-raised
        Path(temp).unlink(missing_ok=True)
        raise


def read_records(state: Path) -> dict[str, ServiceRecord | None]:
    """The record of each service with a PID file; None for a file that is not a record (it names nothing)."""
    found: dict[str, ServiceRecord | None] = {}
    for name in SERVICES:
        try:
            found[name] = ServiceRecord.model_validate_json(pid_file(state, name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValidationError):
            found[name] = None
    return found


def leader_runs(record: ServiceRecord) -> bool:
    """The process ``up`` started still runs: same boot, same start time (a service ``up`` finds running)."""
    return _same_boot(record) and start_ticks(record.pid) == record.start_ticks


def _same_boot(record: ServiceRecord) -> bool:
    return record.boot_id is not None and record.start_ticks is not None and record.boot_id == boot_id()


def owned(record: ServiceRecord) -> bool:
    """The recorded process group is still the one ``up`` started, so signalling it reaches nothing else.

    Either its leader runs with the recorded start time in the recorded boot, or the leader is gone but its
    group is not: the kernel reuses no PID while a process group still carries it as its id, so members of
    group ``pid`` are the leader's own children (Ray's raylet and GCS under ``ray start --block``).
    """
    if not _same_boot(record):
        return False
    ticks = start_ticks(record.pid)
    if ticks is not None:
        return ticks == record.start_ticks
    return _group_exists(record.pid)


def stop(record: ServiceRecord, timeout_s: float, reap: Callable[[], object] = lambda: None) -> str:
    """SIGTERM the service's process group, SIGKILL what is left after ``timeout_s``; only while ``owned``.

    ``reap``: ``Popen.poll`` of a leader this process started, which stays a zombie (and ``owned``) until reaped.
    """
    if not owned(record):
        reused = start_ticks(record.pid) is not None
        return f"not running (pid {record.pid} is another process now)" if reused else "not running"
    if (refused := _signal_group(record, signal.SIGTERM)) is not None:
        return refused
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reap()
        if not owned(record):  # gone (and its PID possibly someone else's already): nothing more to send
            return "stopped"
        time.sleep(0.3)
    return _signal_group(record, signal.SIGKILL) or "killed"


def _signal_group(record: ServiceRecord, signum: signal.Signals) -> str | None:
    """None once sent; otherwise why not (it ended meanwhile, or a member is not ours to signal)."""
    try:
        os.killpg(record.pid, signum)
    except ProcessLookupError:
        return "stopped"
    except PermissionError:  # a member runs as another user (setuid): say so instead of failing `down`
        return f"not stopped: no permission to signal process group {record.pid} (see {record.log})"
    return None


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def state_lock(state: Path, command: str) -> Iterator[None]:
    """Hold the state folder for one ``up`` or ``down``; another one fails at once, naming the holder.

    ``flock``: the kernel drops the lock when its holder exits, however it ends (SIGKILL included), so no stale
    lock is ever left. The services do not inherit the descriptor, so the lock ends with the command.
    """
    state.mkdir(parents=True, exist_ok=True)
    path = state / "rayline.lock"
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.seek(0)
            holder = lock.read().strip() or "`rayline up` or `rayline down`"
            raise PlatformBusy(
                f"another {holder} holds the state folder {state}: wait for it to end, then run this again"
            ) from exc
        lock.seek(0)
        lock.truncate()
        lock.write(f"`rayline {command}` (pid {os.getpid()})")
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)  # before the lock goes: a waiting reader never names a holder that has ended
