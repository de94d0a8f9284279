"""Commands whose options are a request model's fields, so that an option is written once: on the model.

Every field (a nested model's too: ``shape.batch_size`` is ``--batch-size``) is an option named after it
unless the command renames it; its type, choices, default and help come from the field. The checks stay on
the model, which builds the request once from what was typed and names the options in its errors.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from datetime import date
from typing import Annotated, Any, get_args

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rayline.cli.common import fail
from rayline.errors import ConfigError, RaylineError

Command = Callable[..., None]


def _fields(model: type[BaseModel]) -> Iterator[tuple[str | None, str, FieldInfo]]:
    """Each field as (the nested model's field or None, its name, the field): a nested model stands for its own."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from ((name, leaf, nested) for _, leaf, nested in _fields(field.annotation))
        else:
            yield None, name, field


def _option(name: str, field: FieldInfo, option: str) -> inspect.Parameter:
    # a day is read as text, for the model to parse and name: the shell's own dates want a time too
    kind = str | None if date in get_args(field.annotation) else field.annotation
    annotation = Annotated[kind, typer.Option(option, help=field.description)]  # type: ignore[valid-type]
    default = field.get_default(call_default_factory=True)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def request_options(model: type[BaseModel], renamed: Mapping[str, str]) -> Callable[[Command], Command]:
    """Decorate a command whose first parameter is a ``model``: the shell offers the model's fields as options
    (``renamed``: a field's option, when not ``--<field>``) and passes the request built from them; a refused
    request exits as every refusal does (3), naming its options."""
    fields = list(_fields(model))
    options = {name: renamed.get(name, "--" + name.replace("_", "-")) for _, name, _ in fields}
    assert len(options) == len(fields), f"two fields of {model.__name__} share a name: rename one's option"

    def decorate(command: Command) -> Command:
        own = [p.replace(kind=p.KEYWORD_ONLY) for p in inspect.signature(command, eval_str=True).parameters.values()]

        @functools.wraps(command)
        def run(**typed: Any) -> None:
            values: dict[str, Any] = {}
            for parent, name, _ in fields:
                (values.setdefault(parent, {}) if parent else values)[name] = typed.pop(name)
            try:
                request = model.model_validate(values, context=options)
            except ValidationError as exc:
                problems = [
                    f"{options.get('.'.join(map(str, e['loc'][-1:])), '')} {e['input']!r}: {e['msg']}"
                    for e in exc.errors()
                ]
                fail(ConfigError("; ".join(problems)))
            except RaylineError as exc:
                fail(exc)
            command(request, **typed)

        parameters = [*(_option(name, field, options[name]) for _, name, field in fields), *own[1:]]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate
