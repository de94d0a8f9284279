"""Helpers shared by the CLI modules."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from enum import IntEnum
from typing import Annotated, Any, NoReturn, ParamSpec, TextIO

import typer
from pydantic import BaseModel

from rayline.config import apply_process_defaults, get_settings
from rayline.errors import (
    AliasConflict,
    ConfigError,
    InputDataError,
    LeaseBusy,
    NightCommittedElsewhere,
    PlatformBusy,
    RaylineError,
    TransientError,
)


class ExitCode(IntEnum):
    """What a script or scheduler running ``rayline`` learns from its exit status (docs/cli.md)."""

    OK = 0
    FAILED = 1  # the work failed: a stage's error, a rollout rolled back, a night that failed
    USAGE = 2  # the command line itself (click's own code)
    REFUSED = 3  # bad input or configuration, refused before or while reading it: fix it, then run again
    BUSY = 4  # another run holds what this one needs (a lease, an alias, the platform): run again later
    TRANSIENT = 5  # storage or the cluster stayed unavailable through every retry: run again later


# --json: the result, dumped, is the whole of stdout; everything else the command prints goes to stderr
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the result as JSON (for another program), not the summary.")
]
_json_stdout: TextIO | None = None


def reserve_stdout_for_json() -> None:
    """Send everything written to stdout (Ray's and Prefect's lines, native code's too) to stderr, and keep
    the real stdout for the JSON document. A captured stdout (no file descriptor) is left alone."""
    global _json_stdout
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    sys.stdout.flush()
    _json_stdout = os.fdopen(os.dup(descriptor), "w")
    os.dup2(sys.stderr.fileno(), descriptor)


def echo_json(result: Any) -> None:
    """``result`` (a pydantic model, a dataclass or plain data) as JSON on stdout."""
    if isinstance(result, BaseModel):
        text = result.model_dump_json(indent=2)
    else:
        plain = (
            dataclasses.asdict(result) if dataclasses.is_dataclass(result) and not isinstance(result, type) else result
        )
        text = json.dumps(plain, indent=2, default=str)
    out = _json_stdout or sys.stdout
    out.write(text + "\n")
    out.flush()


def exit_code(exc: BaseException) -> ExitCode:
    if isinstance(exc, ConfigError | InputDataError):
        return ExitCode.REFUSED
    if isinstance(exc, LeaseBusy | PlatformBusy | AliasConflict | NightCommittedElsewhere):
        return ExitCode.BUSY
    if isinstance(exc, TransientError):
        return ExitCode.TRANSIENT
    return ExitCode.FAILED


def fail(exc: BaseException) -> NoReturn:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=exit_code(exc)) from exc


P = ParamSpec("P")


def reports_errors(command: Callable[P, None]) -> Callable[P, None]:
    """The command's RaylineError ends it with ``error: <message>`` and its kind's exit code, not a traceback."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except RaylineError as exc:
            fail(exc)

    return run


def before_flow(quiet: bool = True) -> None:
    """What a command does before it starts a flow: the process defaults, Ray's progress bars and INFO lines
    off (``quiet``), and the settings read, so that a bad one fails before Prefect and Ray start."""
    apply_process_defaults()
    if quiet:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        for name in ("ray", "ray.data", "ray.data._internal"):
            logging.getLogger(name).setLevel(logging.WARNING)
    get_settings()
