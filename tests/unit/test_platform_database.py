"""`rayline up`'s PostgreSQL URL: the form it takes, each tool's URL made from it, and its password never shown.

A real server's answers (a wrong password, a missing database, a refused port): tests/e2e/test_failed_up.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from rayline.cli.platform_database import parse, platform_databases, shown_databases
from rayline.config import Settings
from rayline.errors import ConfigError

pytestmark = pytest.mark.unit

SECRET = "s3cr@t/pa:ss"  # quoted in a URL: %40, %2F, %3A
URL = "postgresql://ops:s3cr%40t%2Fpa%3Ass@db.internal:6543/prefect_prod?sslmode=require"


def test_each_tool_gets_its_driver_and_the_password_as_given() -> None:
    database = parse(URL)
    assert (database.host, database.port, database.user, database.name) == ("db.internal", 6543, "ops", "prefect_prod")
    assert database.password == SECRET
    assert database.prefect_url() == (
        "postgresql+asyncpg://ops:s3cr%40t%2Fpa%3Ass@db.internal:6543/prefect_prod?ssl=require"
    )  # asyncpg calls libpq's sslmode `ssl`
    assert (
        database.mlflow_uri()
        == "postgresql+psycopg://ops:s3cr%40t%2Fpa%3Ass@db.internal:6543/prefect_prod?sslmode=require"
    )


def test_the_password_is_masked_where_shown() -> None:
    database = parse(URL)
    assert database.masked() == "postgresql://ops:***@db.internal:6543/prefect_prod?sslmode=require"
    assert SECRET not in repr(database) and "s3cr" not in repr(database)


def test_mlflow_gets_a_database_of_its_own_on_the_same_server() -> None:
    databases = platform_databases(Settings(database_url=SecretStr("postgres://ops:pw@db.internal")))
    assert databases is not None
    assert databases.prefect.masked() == "postgresql://ops:***@db.internal:5432/prefect"
    assert databases.mlflow.masked() == "postgresql://ops:***@db.internal:5432/mlflow"
    assert databases.mlflow.password == "pw"
    with pytest.raises(ConfigError, match="MLflow needs a database of its own"):
        platform_databases(Settings(database_url=SecretStr(URL), mlflow_database="prefect_prod"))


def test_without_a_url_both_stay_in_sqlite_in_the_state_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert platform_databases(Settings()) is None
    assert shown_databases(Settings(), tmp_path) == {
        "prefect": f"sqlite+aiosqlite:///{tmp_path}/prefect/prefect.db",
        "mlflow": f"sqlite:///{tmp_path}/mlflow/mlflow.db",
    }


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://ops:s3cr3t@db/prefect", "must be a PostgreSQL URL"),
        ("postgresql://:s3cr3t@db/prefect", "names no user"),
        ("postgresql://ops:s3cr3t@/prefect", "names no host"),
        ("postgresql://ops:s3cr3t@db:port/prefect", "could not be cast to integer"),
        ("postgresql://ops:s3cr3t@db/prefect/x", "one name after the host"),
        ("postgresql://ops:s3cr3t@db/prefect?host=/run/postgresql", "only sslmode is taken"),
        ("postgresql://ops:s3cr3t@db/prefect?sslmode=strict", "sslmode=strict is none of"),
    ],
)
def test_a_malformed_url_is_refused_without_quoting_it(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        parse(url)
    assert "s3cr3t" not in str(refused.value) and "RAYLINE_DATABASE_URL" in str(refused.value)
