"""A real PostgreSQL server on loopback for the tests: Debian's package, started by PID as an unprivileged user.

``postgres`` and ``initdb`` refuse to run as root (the tests do): they run as the ``postgres`` user the Debian
package creates, on a data folder it owns under the temp folder (pytest's own temp folders are root's, closed to
other users). Password authentication (SCRAM) on TCP only, as a platform team's server asks for it: a wrong
password is refused for real. Two databases, ``prefect`` and ``mlflow``, owned by an ordinary role, as
docs/operations.md tells a platform team to create them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import free_port, stop_process

ROLE = "rayline"
DATABASES = ("prefect", "mlflow")
_SUPERUSER = "postgres"
_OS_USER = "postgres"  # the Debian package's system user


@dataclass(frozen=True)
class PostgresServer:
    port: int
    password: str  # the role's: what a platform team puts in RAYLINE_DATABASE_URL

    def url(self, database: str = "prefect", password: str | None = None) -> str:
        """``postgresql://rayline:<password>@127.0.0.1:<port>/<database>``, the role's password unless given."""
        return f"postgresql://{ROLE}:{self.password if password is None else password}@127.0.0.1:{self.port}/{database}"


def postgres_bin_dir() -> Path:
    """The newest installed PostgreSQL's programs (Debian keeps them off PATH); a failure under CI (``.ci/run``
    installs the package), else a skip."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name))
    if not found:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is missing: .ci/run installs it (apt-get install postgresql)")
        pytest.skip("needs PostgreSQL (apt-get install postgresql)")
    return found[-1].parent


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """PostgreSQL on a free loopback port with role ``rayline`` owning ``prefect`` and ``mlflow``; stopped by PID
    and its folder removed after."""
    bin_dir = postgres_bin_dir()
    user = pwd.getpwnam(_OS_USER)
    folder = Path(tempfile.mkdtemp(prefix="rayline-pg-"))
    os.chown(folder, user.pw_uid, user.pw_gid)
    superuser_password, role_password = "pg-super-" + os.urandom(6).hex(), "pg-role-" + os.urandom(6).hex()
    server: subprocess.Popen[bytes] | None = None
    try:
        password_file = folder / "superuser-password"
        password_file.write_text(superuser_password)
        os.chown(password_file, user.pw_uid, user.pw_gid)
        _as_postgres(
            [str(bin_dir / "initdb"), "-D", str(folder / "data"), "-U", _SUPERUSER, f"--pwfile={password_file}",
             "--auth=scram-sha-256", "--encoding=UTF8", "--no-sync"],
            folder,
        )  # fmt: skip
        port = free_port()
        # TCP on 127.0.0.1 only (no socket file); fsync off: what a test keeps needs no crash safety
        command = [
            str(bin_dir / "postgres"), "-D", str(folder / "data"), "-p", str(port), "-c", "listen_addresses=127.0.0.1",
            "-c", "unix_socket_directories=", "-c", "fsync=off", "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off",
        ]  # fmt: skip
        with (folder / "server.log").open("ab") as log:
            server = subprocess.Popen(
                command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                user=user.pw_uid, group=user.pw_gid, extra_groups=[],
            )  # fmt: skip
        _create_role_and_databases(port, superuser_password, role_password, server, folder / "server.log")
        yield PostgresServer(port=port, password=role_password)
    finally:
        if server is not None:
            stop_process(server, timeout_s=30)  # SIGTERM: a smart shutdown; every client is gone by now
        shutil.rmtree(folder, ignore_errors=True)


def _as_postgres(command: list[str], cwd: Path) -> None:
    user = pwd.getpwnam(_OS_USER)
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=120,
        user=user.pw_uid, group=user.pw_gid, extra_groups=[],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _create_role_and_databases(
    port: int, superuser_password: str, role_password: str, server: subprocess.Popen[bytes], log: Path
) -> None:
    import psycopg

    deadline = time.monotonic() + 60
    while True:
        try:
            connection = psycopg.connect(
                host="127.0.0.1", port=port, user=_SUPERUSER, password=superuser_password, dbname="postgres",
                autocommit=True, connect_timeout=5,
            )  # fmt: skip
            break
        except psycopg.OperationalError:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    with connection:
        connection.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{role_password}'")
        for database in DATABASES:
            connection.execute(f"CREATE DATABASE {database} OWNER {ROLE}")
