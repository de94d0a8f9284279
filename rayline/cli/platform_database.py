"""PostgreSQL for ``rayline up``: the Prefect server's database and MLflow's backend store on one server.

``RAYLINE_DATABASE_URL`` (or ``up --database-url``) is ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE``, the
form Prefect's and MLflow's own URLs take: DATABASE (``prefect`` when left out) holds the Prefect server's tables,
``RAYLINE_MLFLOW_DATABASE`` (``mlflow``) on the same server, as the same user, MLflow's. Two databases, because
both tools migrate their schema with Alembic, each keeping its revision in a table named ``alembic_version``:
in one database each would take the other's revision for its own. Each service gets the URL of its own driver
(asyncpg for Prefect, psycopg 3 for MLflow) in its environment, never on a command line or in a PID file.

``up`` connects to each database once before it starts anything, so that a refused connection, a wrong password
or a missing database fails it at once (:class:`DatabaseUnusable`), naming ``host:port/database`` and the reason.
Nothing here prints the password: errors and ``up``'s lines show the URL with ``***`` in its place.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import socket
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rayline.errors import ConfigError, DatabaseUnusable
from rayline.extras import install_hint

if TYPE_CHECKING:
    from rayline.config import Settings

SCHEMES = ("postgresql", "postgres", "postgresql+asyncpg", "postgresql+psycopg", "postgresql+psycopg2")
DEFAULT_PORT = 5432
DEFAULT_DATABASE = "prefect"
# libpq's sslmode values: the one connection option the URL may carry (asyncpg calls it `ssl`)
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
CONNECT_TIMEOUT_S = 10.0
DATABASE_URL_VARIABLE = "RAYLINE_DATABASE_URL"
PREFECT_DATABASE_VARIABLE = "PREFECT_SERVER_DATABASE_CONNECTION_URL"  # Prefect's own: the server's database
_SETTING = DATABASE_URL_VARIABLE
_FORM = "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=MODE]"


@dataclass(frozen=True)
class PostgresDatabase:
    """One database of a PostgreSQL server, as the user and password given reach it."""

    host: str
    port: int
    user: str
    name: str
    password: str | None = field(default=None, repr=False)  # None: libpq's PGPASSWORD or ~/.pgpass
    sslmode: str | None = None

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def masked(self) -> str:
        """The URL to show: ``***`` for the password."""
        return self._url("postgresql", ssl_key="sslmode", hide_password=True)

    def prefect_url(self) -> str:
        """``PREFECT_SERVER_DATABASE_CONNECTION_URL``: the asyncpg driver, which takes sslmode as ``ssl``."""
        return self._url("postgresql+asyncpg", ssl_key="ssl", hide_password=False)

    def mlflow_uri(self) -> str:
        """MLflow's ``--backend-store-uri`` (``MLFLOW_BACKEND_STORE_URI``): SQLAlchemy's psycopg 3 driver."""
        return self._url("postgresql+psycopg", ssl_key="sslmode", hide_password=False)

    def _url(self, driver: str, ssl_key: str, hide_password: bool) -> str:
        from sqlalchemy.engine import URL  # Prefect's and MLflow's: quotes what needs quoting in each part

        query = {ssl_key: self.sslmode} if self.sslmode else {}
        url = URL.create(driver, self.user, self.password, self.host, self.port, self.name, query)
        return url.render_as_string(hide_password=hide_password)


@dataclass(frozen=True)
class PlatformDatabases:
    """Where ``up``'s Prefect server and MLflow server keep their tables on PostgreSQL."""

    prefect: PostgresDatabase
    mlflow: PostgresDatabase


def platform_databases(settings: Settings) -> PlatformDatabases | None:
    """The databases ``settings`` name, checked for form only; None without ``RAYLINE_DATABASE_URL`` (SQLite)."""
    if settings.database_url is None:
        return None
    prefect = parse(settings.database_url.get_secret_value())
    if settings.mlflow_database == prefect.name:
        raise ConfigError(
            f"RAYLINE_MLFLOW_DATABASE is {prefect.name}, the Prefect server's database ({_SETTING}): MLflow needs "
            "a database of its own (both keep their schema's revision in a table named alembic_version)"
        )
    return PlatformDatabases(prefect=prefect, mlflow=replace(prefect, name=settings.mlflow_database))


def checked_databases(settings: Settings, starting: list[str]) -> PlatformDatabases | None:
    """The PostgreSQL databases of ``RAYLINE_DATABASE_URL`` (None: SQLite), each one that a service about to
    start uses connected to once: :class:`DatabaseUnusable` names the one that refused, and why."""
    databases = platform_databases(settings)
    if databases is None:
        return None
    if os.environ.get(PREFECT_DATABASE_VARIABLE):
        raise ConfigError(
            f"{PREFECT_DATABASE_VARIABLE} and {_SETTING} both name the Prefect server's database: unset one"
        )
    using = [("the Prefect server", databases.prefect)] if "prefect" in starting else []
    if "mlflow" in starting and not os.environ.get("MLFLOW_TRACKING_URI"):
        if importlib.util.find_spec("psycopg") is None:
            raise ConfigError(f"MLflow's backend store on PostgreSQL needs psycopg 3: {install_hint('platform')}")
        using.append(("MLflow", databases.mlflow))
    if using:
        check(using)
    return databases


def shown_databases(settings: Settings, state: Path) -> dict[str, str]:
    """Where the Prefect server and the MLflow server of ``up`` keep their tables, as ``up`` prints them: a
    password masked, a URL of Prefect's own variable not shown."""
    databases = platform_databases(settings)
    if databases is not None:
        shown = {"prefect": databases.prefect.masked()}
    elif os.environ.get(PREFECT_DATABASE_VARIABLE):
        shown = {"prefect": f"as {PREFECT_DATABASE_VARIABLE} says"}
    else:
        shown = {"prefect": prefect_sqlite(state)}
    if not os.environ.get("MLFLOW_TRACKING_URI"):  # else the user's own tracking server: none started
        shown["mlflow"] = databases.mlflow.masked() if databases else mlflow_sqlite(state)
    return shown


def prefect_sqlite(state: Path) -> str:
    """The Prefect server's SQLite database in ``up``'s state folder."""
    return f"sqlite+aiosqlite:///{state / 'prefect' / 'prefect.db'}"


def mlflow_sqlite(state: Path) -> str:
    """MLflow's SQLite backend store in ``up``'s state folder."""
    return f"sqlite:///{state / 'mlflow' / 'mlflow.db'}"


def parse(url: str) -> PostgresDatabase:
    """``url`` as a :class:`PostgresDatabase`; a ``ConfigError`` that says what is wrong, never quoting the URL
    (it may hold a password)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme.lower() not in SCHEMES:
        raise ConfigError(f"{_SETTING} must be a PostgreSQL URL, {_FORM}; its scheme is {parts.scheme or 'missing'}")
    if not parts.hostname:
        raise ConfigError(f"{_SETTING} names no host: expected {_FORM}")
    if not parts.username:
        raise ConfigError(f"{_SETTING} names no user: expected {_FORM}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:  # its message quotes the port only
        raise ConfigError(f"{_SETTING}: {exc}; expected {_FORM}") from exc
    name = urllib.parse.unquote(parts.path.lstrip("/")) or DEFAULT_DATABASE
    if "/" in name:
        raise ConfigError(f"{_SETTING} names the database {name!r}: one name after the host, {_FORM}")
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    return PostgresDatabase(
        host=parts.hostname, port=port, user=urllib.parse.unquote(parts.username), name=name, password=password,
        sslmode=_sslmode(parts.query),
    )  # fmt: skip


def _sslmode(query: str) -> str | None:
    options = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(options) - {"sslmode"})
    if unknown:
        raise ConfigError(
            f"{_SETTING} carries the option(s) {', '.join(unknown)}: only sslmode is taken (other TLS settings: "
            "Prefect's PREFECT_SERVER_DATABASE_SQLALCHEMY_CONNECT_ARGS_TLS_*, libpq's PGSSLROOTCERT)"
        )
    if "sslmode" not in options:
        return None
    mode = options["sslmode"][-1]
    if mode not in SSL_MODES:
        raise ConfigError(f"{_SETTING}: sslmode={mode} is none of {', '.join(SSL_MODES)}")
    return mode


def check(databases: list[tuple[str, PostgresDatabase]], timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Connect once to each ``(whose, database)`` at the same time; :class:`DatabaseUnusable` naming every one
    that refused, and why."""
    import asyncpg  # Prefect's own driver, installed with it

    async def problem(database: PostgresDatabase) -> BaseException | None:
        try:
            connection = await asyncpg.connect(
                host=database.host, port=database.port, user=database.user, password=database.password,
                database=database.name, ssl=database.sslmode, timeout=timeout_s,
            )  # fmt: skip
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # TimeoutError is an OSError
            return exc
        await connection.close(timeout=timeout_s)
        return None

    async def all_problems() -> list[BaseException | None]:
        return await asyncio.gather(*(problem(database) for _, database in databases))

    found = [
        (whose, database, exc)
        for (whose, database), exc in zip(databases, asyncio.run(all_problems()), strict=True)
        if exc is not None
    ]
    if found:
        reasons = "; ".join(_reason(whose, database, exc, timeout_s) for whose, database, exc in found)
        raise DatabaseUnusable(reasons) from found[0][2]


def _reason(whose: str, database: PostgresDatabase, exc: BaseException, timeout_s: float) -> str:
    import asyncpg

    head = f"{whose}'s database {database.masked()}"
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return (
            f"{head}: database {database.name} does not exist; create it "
            f"(CREATE DATABASE {database.name} OWNER {database.user})"
        )
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        where_from = "the URL's password" if database.password is not None else "PGPASSWORD or ~/.pgpass"
        # a wrong password or an unknown user (28P01) says no more; another refusal (pg_hba.conf's) says why
        why = "" if isinstance(exc, asyncpg.InvalidPasswordError) else f" ({exc})"
        return f"{head}: authentication failed for user {database.user}{why}; check {where_from}"
    if isinstance(exc, asyncpg.PostgresError):
        return f"{head}: refused ({exc.sqlstate}: {exc})"
    if isinstance(exc, TimeoutError):
        return f"{head}: no answer within {timeout_s:.0f} s"
    if isinstance(exc, socket.gaierror):
        return f"{head}: unknown host {database.host} ({exc.strerror})"
    if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
        return f"{head}: connection refused (is PostgreSQL listening on {database.address}?)"
    return f"{head}: cannot connect ({exc})"
