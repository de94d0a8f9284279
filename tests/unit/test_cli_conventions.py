"""The CLI's conventions for scripts: ``--json`` wherever a command returns a result, and exit codes that
say what kind of failure it was (docs/cli.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from rayline.cli import app
from rayline.cli.common import ExitCode, exit_code
from rayline.errors import (
    AliasConflict,
    ClusterError,
    ConfigError,
    ErrorBudgetExceeded,
    InputDataError,
    LeaseBusy,
    NightCommittedElsewhere,
    PlatformBusy,
    RaylineError,
    RetriesExhausted,
    RolloutRolledBack,
    StorageError,
    TransientStorageError,
)

pytestmark = pytest.mark.unit

# Commands that print no result of their own: the demo is a tour of the others.
NO_RESULT = {"demo"}


def _commands(group: Any, prefix: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer's own click)
            found.update(_commands(command, f"{prefix}{name} "))
        else:
            found[prefix + name] = command
    return found


def test_every_command_that_returns_a_result_takes_json() -> None:
    commands = _commands(typer.main.get_group(app))
    assert {"nightly-inference", "serve rollout", "register-model", "vacuum", "up"} <= set(commands)
    missing = [
        name
        for name, command in commands.items()
        if name not in NO_RESULT and "--json" not in {o for p in command.params for o in p.opts}
    ]
    assert not missing, f"no --json on {missing}"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("bad --from"), ExitCode.REFUSED),
        (InputDataError("no objects under s3://b/x"), ExitCode.REFUSED),
        (ErrorBudgetExceeded("3 of 24 inputs failed"), ExitCode.REFUSED),
        (LeaseBusy("held by run a"), ExitCode.BUSY),
        (PlatformBusy("another up"), ExitCode.BUSY),
        (AliasConflict("champion moved"), ExitCode.BUSY),
        (NightCommittedElsewhere("run b committed"), ExitCode.BUSY),
        (TransientStorageError("503 SlowDown"), ExitCode.TRANSIENT),
        (ClusterError("no Ray"), ExitCode.TRANSIENT),
        (StorageError("refusing to commit"), ExitCode.FAILED),
        (RolloutRolledBack("p95 too high"), ExitCode.FAILED),
        (RetriesExhausted("train", 3, "worker died"), ExitCode.FAILED),
        (RaylineError("anything else"), ExitCode.FAILED),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_each_kind_of_failure_has_its_exit_code(error: RaylineError, code: ExitCode) -> None:
    assert exit_code(error) == code


def test_vacuum_prints_its_result_as_json_and_a_refusal_exits_3(local_storage: str) -> None:
    done = CliRunner().invoke(app, ["vacuum", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {"dry_run": True, "retention_hours": 168, "files": {}}  # notes: stderr
    refused = CliRunner().invoke(app, ["nightly-inference", "--from", "2026-11-02", "--to", "2026-11-01", "--json"])
    assert refused.exit_code == ExitCode.REFUSED, refused.output


def test_seed_data_prints_its_result_as_json(tmp_path: Path) -> None:
    done = CliRunner().invoke(app, ["seed-data", "--to", str(tmp_path / "raw"), "--corrupt", "2", "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert result["digits"] == 1797 and len(result["corrupt"]) == 2 and result["uri"].endswith("/raw")
