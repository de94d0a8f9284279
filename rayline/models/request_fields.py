"""What every stage's request shares: the names a caller gave its fields (for errors that name what the user
typed), a ``NAME@ref`` split once, and days parsed once."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo

from rayline.errors import ConfigError
from rayline.models.refs import parse_named_ref
from rayline.storage.layout import parse_day


def label(info: ValidationInfo, field: str) -> str:
    """What the caller calls ``field``: the name in the validation context (``--from``), else the field's own."""
    return str((info.context or {}).get(field, field))


def a_day(value: object, info: ValidationInfo) -> object:
    """A ``YYYY-MM-DD`` text as a day, refused naming the field as the caller spelled it."""
    return parse_day(value, label(info, str(info.field_name))) if isinstance(value, str) else value


def split_named_ref(data: Any, ref_field: str, info: ValidationInfo) -> Any:
    """``NAME@ref`` in ``ref_field`` names the model as well as its version: ``model_name`` gets the name, which
    must agree with a ``model_name`` given too."""
    if not isinstance(data, dict) or "@" not in str(data.get(ref_field, "")):
        return data
    name, ref = parse_named_ref(data[ref_field])
    given = data.get("model_name")
    if given is not None and given != name:
        raise ConfigError(f"{data[ref_field]} names model {name!r} but {label(info, 'model_name')} is {given!r}")
    return {**data, ref_field: ref, "model_name": name}
