"""Helpers shared by the CLI modules."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import NoReturn

import typer

from rayline.errors import ConfigError

DEFAULT_MODEL_NAME = "digits"


# typer takes a fixed set of values as an Enum; these mirror ray_workloads.execution.plan's Literals
class PlanMode(StrEnum):
    auto = "auto"
    off = "off"


class PrecisionChoice(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class BackendChoice(StrEnum):
    eager = "eager"
    openvino = "openvino"


def quiet_ray() -> None:
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    for name in ("ray", "ray.data", "ray.data._internal"):
        logging.getLogger(name).setLevel(logging.WARNING)


def fail(exc: BaseException) -> NoReturn:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2) from exc


def model_ref(model: str, model_name: str | None) -> tuple[str, str]:
    """(name, alias or version) from ``--model`` and ``--model-name``; the two must not disagree."""
    from rayline.models import registry

    name, ref = registry.parse_ref(model, model_name or DEFAULT_MODEL_NAME)
    if model_name is not None and name != model_name:
        raise ConfigError(f"{model} names model {name!r} but --model-name is {model_name!r}: give one")
    return name, ref
