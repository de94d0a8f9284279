"""Model references as users type them, ``NAME@champion`` or ``NAME@v3``, parsed without the registry (no storage).

Resolving a bare word that may be a model's name needs the registry: ``rayline.models.registry.parse_ref``.
"""

from __future__ import annotations

from rayline.errors import ConfigError
from rayline.specs import NAME_PATTERN, check_model_name

CHAMPION = "champion"


def parse_named_ref(text: str, *, default_ref: str = CHAMPION) -> tuple[str, str]:
    """``NAME``, ``NAME@alias`` or ``NAME@vN`` → (name, alias or version); a bare name means ``default_ref``."""
    name, ref = split_ref(text)
    if name is None:  # a bare word is the name; the ref is the default
        return check_model_name(ref), check_ref(default_ref)
    return check_model_name(name), check_ref(ref)


def split_ref(text: str) -> tuple[str | None, str]:
    """``NAME@REF`` → (NAME, REF); a bare word → (None, word)."""
    name, at, ref = text.strip().partition("@")
    if not at:
        return None, name
    if not ref:
        raise ConfigError(f"model reference {text!r}: nothing after '@' (try {name}@champion or {name}@v3)")
    return name, ref


def check_ref(ref: str) -> str:
    """``ref`` as given when it is an alias's name or a version (``v3``, ``3``); else a ConfigError."""
    if ref.lstrip("v").isdigit() or NAME_PATTERN.match(ref):
        return ref
    raise ConfigError(f"{ref!r} is neither an alias (champion, challenger) nor a version (v3)")
