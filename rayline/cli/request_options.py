"""A command's options made from a stage's request model: one option per field, with the field's default and
description, handed to the command as the one request they make. A field added to the model is an option.

The model checks the values (its bounds, its validators): a value it refuses exits as refused input, naming
the option.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rayline.cli.common import fail
from rayline.errors import ConfigError, RaylineError

Command = Callable[..., None]


def request_options(model: type[BaseModel], flags: Mapping[str, str] | None = None) -> Callable[[Command], Command]:
    """Give a command taking ``request: model`` (and options of its own) an option per field of ``model``.

    ``flags``: an option's spelling where it is not the field's name (``{"source_uri": "--source"}``).
    """
    spelled = dict(flags or {})

    def decorate(command: Command) -> Command:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "request"]
        options = [_option(name, field, spelled.get(name)) for name, field in model.model_fields.items()]

        @functools.wraps(command)
        def run(**values: Any) -> None:
            given = {name: values.pop(name) for name in model.model_fields}
            try:
                request = _request(model, given, spelled)
            except RaylineError as exc:
                fail(exc)
            command(request=request, **values)

        parameters = [*options, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own)]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate


def _request(model: type[BaseModel], given: dict[str, Any], flags: Mapping[str, str]) -> BaseModel:
    """``model`` of the options given (an option left out is the field's default); what it refuses is a
    :class:`ConfigError` naming the options."""
    for name, field in model.model_fields.items():
        if typing.get_origin(field.annotation) is dict and given[name] is not None:
            given[name] = _json_object(_flag(name, flags), given[name])
    try:
        return model(**{name: value for name, value in given.items() if value is not None})
    except ValidationError as exc:
        problems = [f"{_flag(str(e['loc'][0]) if e['loc'] else '', flags)}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("; ".join(problems)) from exc


def _flag(name: str, flags: Mapping[str, str]) -> str:
    """The option of a field, as the command line spells it."""
    return flags.get(name, "--" + name.replace("_", "-")).split("/")[0]


def _json_object(flag: str, text: str) -> dict[str, Any]:
    """A JSON object given on the command line, or a ConfigError naming the option."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"width\": 64}}': {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def _option(name: str, field: FieldInfo, flags: str | None) -> inspect.Parameter:
    """The option of a field: typer takes no dict, so a JSON object goes as text."""
    kind = str if typing.get_origin(field.annotation) is dict else field.annotation
    default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=False)
    option = typer.Option(*([flags] if flags else []), help=field.description)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])
