"""One `rayline up` for the e2e package, stopped by PID after its last test.

test_platform.py and test_work_pool.py run on the same platform (a Prefect server, a
Ray head, a Prefect worker) in file order, as a user's session would; package scope
ends it before the integration tests start.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.platform_support import running_platform


@pytest.fixture(scope="package")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running_platform(tmp_path_factory) as env:
        yield env
