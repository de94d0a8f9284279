"""Helpers shared by the CLI modules."""

from __future__ import annotations

import logging
from typing import NoReturn

import typer


def quiet_ray() -> None:
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    for name in ("ray", "ray.data", "ray.data._internal"):
        logging.getLogger(name).setLevel(logging.WARNING)


def fail(exc: BaseException) -> NoReturn:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2) from exc
