"""One PostgreSQL server and one `rayline up` on it for the e2e package, stopped by PID after its last test.

test_platform.py and test_work_pool.py run on the same platform (a Prefect server and an MLflow server keeping
their tables on PostgreSQL, a Ray head, a Prefect worker) in file order, as a user's session would; package scope
ends it before the integration tests start. test_failed_up.py's `up` with a wrong password asks the same server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.platform_support import running_platform
from tests.postgres_support import PostgresServer, postgres_server


@pytest.fixture(scope="package")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="package")
def platform(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresServer) -> Iterator[dict[str, str]]:
    with running_platform(tmp_path_factory, database_url=postgres.url()) as env:
        yield env
