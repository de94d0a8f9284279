"""A command's options made from a stage's request model: one option per field (a nested model's fields too:
``shape.actors`` is ``--actors``), with the field's type, default and description, handed to the command as
the one request they make. A field added to the model is an option.

The model checks the values (its bounds, its validators), once: a value it refuses exits as refused input,
naming the option; its own messages name the options too, which it is given as its validation context.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Iterator, Mapping
from datetime import date
from typing import Annotated, Any

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rayline.cli.common import fail
from rayline.errors import ConfigError, RaylineError

Command = Callable[..., None]


def request_options(
    model: type[BaseModel],
    flags: Mapping[str, str] | None = None,
    *,
    arguments: frozenset[str] = frozenset(),
    hidden: frozenset[str] = frozenset(),
) -> Callable[[Command], Command]:
    """Give a command taking ``request: model`` (and options of its own) an option per field of ``model``.

    ``flags``: an option's spelling where it is not the field's name (``{"source_uri": "--source"}``).
    ``arguments``: fields given as positional arguments (``labels import FILE``); ``hidden``: fields the command
    line leaves to their defaults (what only a flow or a deployment sets).
    """
    fields = [f for f in _fields(model) if f[1] not in hidden]
    spelled = {name: (flags or {}).get(name, _flag(name, field)) for _, name, field in fields}
    labels = {name: flag.split("/")[0] for name, flag in spelled.items()}
    assert len(spelled) == len(fields), f"two fields of {model.__name__} share a name: spell one's option"

    def decorate(command: Command) -> Command:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "request"]

        @functools.wraps(command)
        def run(**values: Any) -> None:
            given: dict[str, Any] = {}
            try:
                for parent, name, field in fields:
                    if (value := values.pop(name)) not in (None, [], ()):  # left out: the field's default
                        value = _json_object(labels[name], value) if _is_dict(field) else value
                        (given.setdefault(parent, {}) if parent else given)[name] = value
                request = model.model_validate(given, context=labels)
            except ValidationError as exc:
                fail(ConfigError("; ".join(_problem(e, labels) for e in exc.errors())))
            except RaylineError as exc:
                fail(exc)
            command(request=request, **values)

        options = [_option(name, field, spelled[name], name in arguments) for _, name, field in fields]
        parameters = [*options, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own)]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate


def _flag(name: str, field: FieldInfo) -> str:
    """``--name``; a yes/no field's both ways (``--check-serving/--no-check-serving``): a default of yes can be
    turned off, and a default of none (the settings decide) told either way."""
    flag = "--" + name.replace("_", "-")
    return f"{flag}/--no-{flag[2:]}" if bool in (field.annotation, *typing.get_args(field.annotation)) else flag


def _fields(model: type[BaseModel]) -> Iterator[tuple[str | None, str, FieldInfo]]:
    """Each field as (the nested model's field or None, its name, the field): a nested model's stand for it."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from ((name, leaf, nested) for _, leaf, nested in _fields(field.annotation))
        else:
            yield None, name, field


def _is_dict(field: FieldInfo) -> bool:
    return typing.get_origin(field.annotation) is dict


def _problem(error: Any, labels: Mapping[str, str]) -> str:
    """One refused value, named by its option: ``--actors 0: Input should be greater than or equal to 1``."""
    flag = next((labels[str(part)] for part in reversed(error["loc"]) if str(part) in labels), "")
    return f"{flag} {error['input']!r}: {error['msg']}"


def _json_object(flag: str, text: str) -> dict[str, Any]:
    """A JSON object given on the command line, or a ConfigError naming the option."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"width\": 64}}': {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def _option(name: str, field: FieldInfo, flag: str, positional: bool) -> inspect.Parameter:
    """The option of a field: typer takes no dict, so a JSON object goes as text, and a day goes as text for the
    model to parse (naming the option), since typer's own dates want a time too."""
    kind = (
        str if _is_dict(field) or date in (field.annotation, *typing.get_args(field.annotation)) else field.annotation
    )
    default = inspect.Parameter.empty if field.is_required() else None if field.default_factory else field.default
    option = typer.Argument(help=field.description) if positional else typer.Option(flag, help=field.description)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])
