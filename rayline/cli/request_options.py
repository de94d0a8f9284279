"""A command's options made from a stage's request model: one option per field, with the field's default and
description, handed to the command as the one request they make. A field added to the model is an option.

The model checks the values (its bounds, its validators): a value it refuses exits as refused input, naming
the option.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rayline.cli.common import fail
from rayline.errors import ConfigError, RaylineError

Request = TypeVar("Request", bound=BaseModel)
Command = Callable[..., None]


def request_options(model: type[BaseModel], flags: Mapping[str, str] | None = None) -> Callable[[Command], Command]:
    """Give a command taking ``request: model`` (and options of its own) an option per field of ``model``.

    ``flags``: an option's spelling where it is not the field's name (``{"source_uri": "--source"}``).
    """
    spelled = dict(flags or {})

    def decorate(command: Command) -> Command:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(command, eval_str=True).parameters.values()
            if p.name != "request"
        ]
        options = [_option(name, field, spelled.get(name)) for name, field in model.model_fields.items()]

        @functools.wraps(command)
        def run(**values: Any) -> None:
            fields = {name: values.pop(name) for name in model.model_fields}
            try:
                request = checked(model, fields, spelled)
            except RaylineError as exc:
                fail(exc)
            command(request=request, **values)

        parameters = [*options, *own]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate


def checked(model: type[Request], values: dict[str, Any], flags: Mapping[str, str] | None = None) -> Request:
    """``model`` of ``values``; what its fields' bounds refuse is a :class:`ConfigError` naming the options."""
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{_flag(e['loc'], flags)}: {e['msg']} (got {e['input']!r})" for e in exc.errors())
        raise ConfigError(problems) from exc


def _flag(loc: tuple[int | str, ...], flags: Mapping[str, str] | None) -> str:
    """The option a field's error is about, as the command line spells it."""
    name = str(loc[0]) if loc else "request"
    return (flags or {}).get(name, "--" + name.replace("_", "-")).split("/")[0]


def _option(name: str, field: FieldInfo, flags: str | None) -> inspect.Parameter:
    # typer takes no Literal: its values go as text, and the model refuses any other
    kind = str if typing.get_origin(field.annotation) is Literal else field.annotation
    option = typer.Option(*([flags] if flags else []), help=field.description)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=Annotated[kind, option]
    )
